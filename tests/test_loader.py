import os
import time

import numpy as np
import pytest
import torch

import trainfast
from trainfast import Augment, Loader
from trainfast.errors import TrainfastError


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (103, 8, 12, 3), dtype=np.uint8)
    return trainfast.pack((images, np.arange(103) % 7), tmp / "p", size=(8, 12), progress=False)


def _labels_of(loader):
    return np.concatenate([y.cpu().numpy() for _, y in loader])


def test_batches_shapes_layout_and_values(pack, device):
    loader = Loader(pack, batch_size=10, shuffle=False, drop_last=False, normalize=False, device=device)
    assert len(loader) == 11
    x, y = next(iter(loader))
    assert x.shape == (10, 3, 8, 12) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.is_contiguous(memory_format=torch.channels_last) and x.device.type == device
    expected = torch.from_numpy(np.array(pack.images[:10])).permute(0, 3, 1, 2).float() / 255
    assert torch.allclose(x.cpu(), expected)


def test_uint8_output_is_the_stored_bytes_without_copy_of_layout(pack, device):
    loader = Loader(pack, batch_size=4, shuffle=False, dtype=torch.uint8, device=device)
    x, _ = next(iter(loader))
    assert x.dtype == torch.uint8 and x.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(x.permute(0, 2, 3, 1).cpu().numpy(), pack.images[:4])


def test_normalised_by_pack_mean_std(pack, device):
    x = torch.cat([b for b, _ in Loader(pack, batch_size=103, shuffle=False, device=device)]).cpu()
    assert torch.allclose(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-3)
    assert torch.allclose(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-2)


def test_bf16_output(pack, device):
    x, _ = next(iter(Loader(pack, batch_size=8, dtype=torch.bfloat16, device=device)))
    assert x.dtype == torch.bfloat16


def test_order_fresh_each_epoch_and_deterministic(pack, device):
    a = Loader(pack, batch_size=10, seed=1, device=device)
    e0, e1 = _labels_of(a), _labels_of(a)
    assert a.epoch == 2
    assert not np.array_equal(a.indices(0), a.indices(1))
    b = Loader(pack, batch_size=10, seed=1, device=device)
    assert np.array_equal(_labels_of(b), e0) and np.array_equal(_labels_of(b), e1)
    assert not np.array_equal(Loader(pack, batch_size=10, seed=2, device=device).indices(0), a.indices(0))


def test_drop_last_default_follows_shuffle(pack):
    assert len(Loader(pack, batch_size=10, device="cpu")) == 10
    assert len(Loader(pack, batch_size=10, shuffle=False, device="cpu")) == 11
    assert sum(len(y) for _, y in Loader(pack, batch_size=10, shuffle=False, device="cpu")) == 103


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_shards_disjoint_equal_and_complete(pack, world):
    shards = [Loader(pack, batch_size=5, rank=r, world_size=world, seed=4, device="cpu").indices(3)
              for r in range(world)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == 103 // world
    flat = np.concatenate(shards)
    assert len(set(flat.tolist())) == len(flat)  # disjoint
    assert len(flat) == 103 - 103 % world  # complete but for the remainder
    # the k-th batches of all ranks together are the k-th batch of one process at world × batch
    single = Loader(pack, batch_size=5 * world, seed=4, device="cpu").indices(3)
    k = 1
    together = sorted(np.concatenate([s[k * 5:(k + 1) * 5] for s in shards]).tolist())
    assert together == sorted(single[k * 5 * world:(k + 1) * 5 * world].tolist())


def test_state_dict_resumes_mid_epoch(pack, device):
    full = Loader(pack, batch_size=10, seed=5, device=device)
    ref = [y.clone() for _, y in full] + [y.clone() for _, y in full]
    part = Loader(pack, batch_size=10, seed=5, device=device)
    it = iter(part)
    got = [next(it)[1].clone() for _ in range(4)]
    state = part.state_dict()
    assert state == {"epoch": 0, "position": 4, "seed": 5}
    resumed = Loader(pack, batch_size=10, seed=5, device=device)
    resumed.load_state_dict(state)
    got += [y for _, y in resumed] + [y for _, y in resumed]
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref)


def test_jpeg_pack_loads_like_raw(tmp_path, image_folder, device):
    raw = trainfast.pack(image_folder, tmp_path / "r", size=(16, 16), encoding="raw", progress=False)
    jpg = trainfast.pack(image_folder, tmp_path / "j", size=(16, 16), encoding="jpeg", quality=100, progress=False)
    xr, yr = next(iter(Loader(raw, batch_size=24, seed=0, dtype=torch.uint8, device=device)))
    xj, yj = next(iter(Loader(jpg, batch_size=24, seed=0, dtype=torch.uint8, workers=2, device=device)))
    assert torch.equal(yr, yj)
    assert (xr.float() - xj.float()).abs().mean() < 4


def test_augmentations_change_images_deterministically(pack, device):
    aug = Augment(crop_pad=2, flip=True, brightness=0.3, contrast=0.3, cutout=3)
    a = [x for x, _ in Loader(pack, batch_size=20, seed=1, augment=aug, device=device)]
    b = [x for x, _ in Loader(pack, batch_size=20, seed=1, augment=aug, device=device)]
    plain = [x for x, _ in Loader(pack, batch_size=20, seed=1, device=device)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], plain[0])
    assert a[0].is_contiguous(memory_format=torch.channels_last)


def test_bad_arguments(pack, tmp_path):
    with pytest.raises(TrainfastError, match="too few"):
        Loader(pack, batch_size=1000, device="cpu")
    with pytest.raises(TrainfastError, match="rank"):
        Loader(pack, batch_size=4, rank=2, world_size=2, device="cpu")
    with pytest.raises(TrainfastError, match="need a float dtype"):
        Loader(pack, batch_size=4, dtype=torch.uint8, augment=Augment(brightness=0.1), device="cpu")
    with pytest.raises(TrainfastError, match="not a pack"):
        Loader(tmp_path, batch_size=4, device="cpu")
    with pytest.raises(TrainfastError, match="no such pack"):
        Loader(tmp_path / "missing", batch_size=4, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(TrainfastError, match="cuda"):
            Loader(pack, batch_size=4, device="cuda")
    n = len(pack)
    for subset, says in (([0, 99999], f"index 99999, outside the pack's {n:,} images"), ([-1, 0], "index -1"),
                         ([[0, 1]], "list of whole-number"), ([0.5], "list of whole-number"),
                         ("ab", "list of whole-number")):
        with pytest.raises(TrainfastError, match=f"subset .*{says}"):
            Loader(pack, batch_size=1, subset=subset, device="cpu")
    for arg in ("seed", "batch_size"):
        with pytest.raises(TrainfastError, match=f"{arg} must be a whole number ≥ ., not None"):
            Loader(pack, **{"batch_size": 4, arg: None}, device="cpu")
    with pytest.raises(TrainfastError, match="augment: bogus is not an augmentation"):
        Loader(pack, batch_size=4, augment={"bogus": 1}, device="cpu")
    with pytest.raises(TrainfastError, match="augment must be a trainfast.Augment"):
        Loader(pack, batch_size=4, augment="flip", device="cpu")


def test_augment_as_a_dict_is_the_same_augment(pack):
    a = next(iter(Loader(pack, batch_size=8, seed=1, augment={"crop_pad": 2, "flip": True}, device="cpu")))[0]
    b = next(iter(Loader(pack, batch_size=8, seed=1, augment=Augment(crop_pad=2, flip=True), device="cpu")))[0]
    assert torch.equal(a, b)


def test_colour_path_normalises_like_the_plain_path(pack, device):
    # brightness 1e-9 switches the colour path on but changes nothing measurable
    a = next(iter(Loader(pack, batch_size=16, seed=3, augment=Augment(brightness=1e-9), device=device)))[0]
    b = next(iter(Loader(pack, batch_size=16, seed=3, device=device)))[0]
    assert torch.allclose(a, b, atol=1e-5)


def test_subset_draws_only_from_it(pack):
    subset = np.arange(50, 90)
    loader = Loader(pack, batch_size=8, subset=subset, seed=1, device="cpu")
    seen = np.concatenate([loader.indices(e) for e in range(3)])
    assert set(seen.tolist()) <= set(subset.tolist()) and len(loader) == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_forked_child_iterates_a_loader_its_parent_used(pack):
    """The child inherits the thread pool but not its threads; it must not wait on them for ever."""
    loader = Loader(pack, batch_size=10, device="cpu")
    first = _labels_of(loader)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if a whole epoch came through
        try:
            os._exit(0 if len(_labels_of(loader)) == len(first) else 1)
        finally:
            os._exit(2)
    deadline = time.time() + 30
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the Loader")
    assert os.waitstatus_to_exitcode(status) == 0


def test_iterating_again_after_a_break_continues_the_epoch_then_starts_the_next(pack):
    loader = Loader(pack, batch_size=10, device="cpu", seed=3)
    whole = Loader(pack, batch_size=10, device="cpu", seed=3)
    ref = [y for _, y in whole] + [y for _, y in whole]
    got = []
    for _, y in loader:
        got.append(y)
        if len(got) == 4:
            break
    with pytest.warns(UserWarning, match=r"stopped at batch 4 of .* in epoch 0; this loop goes on from there"):
        got += [y for _, y in loader]  # said once, not silently (a mid-epoch evaluation goes on from there)
    got += [y for _, y in loader]
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("dtype,augment", [(torch.uint8, None), (torch.uint8, Augment(crop_pad=2, flip=True)),
                                           (torch.float32, Augment(translate=2, brightness=0.3, cutout=3))])
def test_resident_pack_gives_the_host_paths_batches(pack, device, dtype, augment):
    """Kept whole on the device or gathered by threads: same order, augmentations and values."""
    kw = {"batch_size": 16, "seed": 5, "dtype": dtype, "augment": augment, "device": device, "subset": np.arange(3, 100)}
    on, off = Loader(pack, resident=True, **kw), Loader(pack, resident=False, **kw)
    assert on.resident and not off.resident
    for _ in range(2):  # two epochs: fresh order, fresh augmentations
        a, b = list(on), list(off)
        assert len(a) == len(b) == 6
        for (xa, ya), (xb, yb) in zip(a, b):
            assert xa.device.type == device and xa.is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(on.batch(3, epoch=1)[0], a[3][0])
    on.set_epoch(4)
    it = iter(on)
    next(it)
    state = on.state_dict()
    rest = [x for x, _ in it]
    again = Loader(pack, resident=True, **kw)
    again.load_state_dict(state)
    assert all(torch.equal(p, q) for p, q in zip(rest, [x for x, _ in again])) and len(rest) == 5


def test_resident_is_chosen_by_device_and_memory(pack, tmp_path, image_folder, monkeypatch, device):
    from trainfast.data import loader as loader_mod
    auto = Loader(pack, batch_size=8, device=device)
    assert auto.resident == (device == "cuda")  # on the CPU the threaded host path is the default
    a, b = Loader(pack, batch_size=8, device=device, resident=True), Loader(pack, batch_size=4, device=device, resident=True)
    assert a._on_device is b._on_device  # one upload per pack and device
    monkeypatch.setattr(loader_mod, "free_memory", lambda dev: pack.images.nbytes)  # fits, but not in half
    loader_mod._uploaded.clear()
    assert not Loader(pack, batch_size=8, device=device).resident
    monkeypatch.setattr(loader_mod, "free_memory", lambda dev: pack.images.nbytes // 2)
    with pytest.raises(TrainfastError, match=r"resident=True.*GiB free"):
        Loader(pack, batch_size=8, device=device, resident=True)
    jpg = trainfast.pack(image_folder, tmp_path / "j", size=(16, 16), encoding="jpeg", progress=False)
    with pytest.raises(TrainfastError, match="jpeg pack"):
        Loader(jpg, batch_size=8, device=device, resident=True)
    assert not Loader(jpg, batch_size=8, device=device).resident


def test_gpu_decode_plumbing_with_an_injected_decoder(tmp_path, image_folder, monkeypatch, device):
    """The threads hand over each image's bytes, one batched call decodes them on the device, and
    the batches are those of the threaded CPU decode (same order, same augmentations)."""
    from trainfast.data import loader as loader_mod
    from trainfast.data.decode import decode_jpeg
    jpg = trainfast.pack(image_folder, tmp_path / "j", size=(16, 16), encoding="jpeg", progress=False)
    calls = []

    def fake_decoder(dev, channels):
        def decode(data):
            calls.append(len(data))
            assert all(d.dtype == torch.uint8 and d.dim() == 1 for d in data)
            return [torch.from_numpy(decode_jpeg(d.numpy(), channels)).permute(2, 0, 1).to(dev) for d in data]
        return decode
    monkeypatch.setattr(loader_mod, "gpu_jpeg_decoder", fake_decoder)
    kw = {"batch_size": 8, "seed": 2, "augment": Augment(crop_pad=2, flip=True, brightness=0.2), "device": device}
    gpu, cpu = Loader(jpg, decode="gpu", **kw), Loader(jpg, decode="cpu", **kw)
    assert "decoded on" in gpu.describe() and "threads" in cpu.describe()
    a, b = list(gpu), list(cpu)
    assert calls == [8] * len(a) and len(a) == len(b) > 1
    assert all(torch.equal(x, y) and torch.equal(p, q) for (x, p), (y, q) in zip(a, b))
    assert torch.equal(gpu.batch(1, epoch=0)[0], a[1][0])


def test_decode_choice_errors(tmp_path, image_folder, pack):
    jpg = trainfast.pack(image_folder, tmp_path / "j", size=(16, 16), encoding="jpeg", progress=False)
    with pytest.raises(TrainfastError, match=r"decode='gpu' needs a CUDA device and torchvision"):
        Loader(jpg, batch_size=4, device="cpu", decode="gpu")
    with pytest.raises(TrainfastError, match="decode must be one of"):
        Loader(jpg, batch_size=4, device="cpu", decode="nvjpeg")
    assert Loader(jpg, batch_size=4, device="cpu").describe().startswith("JPEG decoded by")
    assert Loader(pack, batch_size=4, device="cpu", decode="gpu").describe().startswith("raw pack")  # raw: nothing to decode


def test_a_loader_normalises_with_another_packs_statistics(tmp_path):
    """normalize=<training pack>: a held-out pack's images are normalised with the statistics
    the model trained with, not with their own."""
    import trainfast

    rng = np.random.default_rng(0)
    bright = rng.integers(100, 255, (16, 8, 8, 3), dtype=np.uint8)
    train = trainfast.pack((rng.integers(0, 155, (16, 8, 8, 3), dtype=np.uint8), np.arange(16) % 2),
                           tmp_path / "train", progress=False)
    held = trainfast.pack((bright, np.arange(16) % 2), tmp_path / "held", progress=False)
    x, _ = next(iter(Loader(held, 16, shuffle=False, device="cpu", normalize=train)))
    u8 = torch.from_numpy(np.stack([held.image(i) for i in range(16)])).permute(0, 3, 1, 2).float() / 255
    want = (u8 - torch.tensor(train.mean).view(1, 3, 1, 1)) / torch.tensor(train.std).view(1, 3, 1, 1)
    assert torch.allclose(x, want, atol=1e-4)
    own, _ = next(iter(Loader(held, 16, shuffle=False, device="cpu")))
    assert not torch.allclose(own, want, atol=1e-2)  # its own statistics would read other inputs
