"""Checkpoints: the random streams, saved and restored per device; loading on the CPU."""

import pytest
import torch

from trainfast.errors import TrainfastError
from trainfast.train import checkpoint


def test_cpu_stream_is_restored_exactly():
    torch.manual_seed(3)
    saved = checkpoint.rng_state(torch.device("cpu"))
    a = torch.rand(5)
    torch.manual_seed(99)
    assert checkpoint.set_rng_state(saved, torch.device("cpu")) is None
    assert torch.equal(torch.rand(5), a)


def test_old_checkpoints_with_a_bare_cpu_state_still_resume():
    torch.manual_seed(4)
    bare = torch.get_rng_state()
    a = torch.rand(3)
    assert checkpoint.set_rng_state(bare, torch.device("cpu")) is None
    assert torch.equal(torch.rand(3), a)


def test_a_run_saved_on_cuda_resumes_on_cpu_and_says_the_stream_differs():
    """What a CUDA machine saves (a CPU tensor for each stream), read back on a CPU-only one."""
    torch.manual_seed(5)
    saved = {"cpu": torch.get_rng_state(), "device": "cuda", "cuda": torch.zeros(16, dtype=torch.uint8)}
    a = torch.rand(3)
    note = checkpoint.set_rng_state(saved, torch.device("cpu"))
    assert "saved on cuda and resumes on cpu" in note and "dropout" in note
    assert torch.equal(torch.rand(3), a)  # the CPU stream is still restored


def test_checkpoint_tensors_load_on_the_cpu(tmp_path):
    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    checkpoint.save(tmp_path / "c.pt", {"model_name": "lin", "signature": checkpoint.signature(net),
                                        "model": net.state_dict(), "rng": checkpoint.rng_state(torch.device("cpu")),
                                        "optimizer": opt.state_dict(), "scheduler": {},
                                        "loader": {"epoch": 0, "position": 0}, "state": {"epoch": 0, "step": 0}})
    ck = checkpoint.load(tmp_path / "c.pt", "lin", net)
    assert all(t.device.type == "cpu" for t in ck["model"].values())
    assert not list(tmp_path.glob(".*tmp"))  # written atomically: no temporary left


def _first_release_checkpoint(net):
    """The form the first release wrote: the CPU stream bare, no state position, no threads."""
    return {"model_name": "lin", "signature": checkpoint.signature(net), "model": net.state_dict(),
            "optimizer": {}, "scheduler": {}, "scaler": None, "loader": {"seed": 0, "epoch": 0, "position": 3},
            "rng": torch.get_rng_state(), "state": {"epoch": 0, "step": 3, "best": None}}


def test_a_first_release_checkpoint_loads(tmp_path):
    net = torch.nn.Linear(2, 2)
    checkpoint.save(tmp_path / "last.pt", _first_release_checkpoint(net))
    assert checkpoint.load(tmp_path / "last.pt", "lin", net)["state"]["step"] == 3


@pytest.mark.parametrize("rng,threads,says", [
    (torch.zeros(10, dtype=torch.uint8), 2, "CPU random stream is 10 torch.uint8 values, not 5056 bytes"),
    ({"cpu": torch.get_rng_state().float(), "cuda": None}, 2, "CPU random stream is 5056 torch.float32"),
    ({"cpu": "x"}, 2, "CPU random stream is str"),
    ({"cpu": torch.get_rng_state(), "cuda": [1, 2]}, 2, "CUDA random stream is list"),
    (torch.get_rng_state(), 0, "threads is 0"),
    (torch.get_rng_state(), "2", "threads is '2'"),
])
def test_a_checkpoint_with_bad_streams_or_threads_is_refused_in_one_line(tmp_path, rng, threads, says):
    net = torch.nn.Linear(2, 2)
    checkpoint.save(tmp_path / "last.pt", {**_first_release_checkpoint(net), "rng": rng, "threads": threads})
    with pytest.raises(TrainfastError, match=f"last.pt: a damaged checkpoint \\(.*{says}"):
        checkpoint.load(tmp_path / "last.pt", "lin", net)
