"""Loader: batches from a pack, on the device, at memory speed.

Two paths, the same batches (same order, same augmentations for a seed):

- **Resident** (a raw pack that fits a share of the device's free memory; the default on
  CUDA): the pack is uploaded once as uint8, and each batch is one index_select on the
  device. No host work per batch but an index slice.
- **Host**: worker threads gather each batch with one np.take from the memory-mapped NHWC
  array (JPEG packs decode in the same threads, with the GIL released: see decode_jpeg),
  into pinned memory on CUDA. On CUDA the copy to the device runs on a side stream one batch
  ahead, so that it overlaps the step that uses the batch before.
- **GPU decode** (JPEG packs on CUDA with torchvision ≥ 0.20: `pip install trainfast[gpu]`):
  the threads only slice out each image's bytes; one batched nvJPEG call decodes the batch
  on the device.

Then the batch is augmented on the device as whole-batch ops and converted;
`permute(0, 3, 1, 2)` of the NHWC batch is already NCHW in channels_last memory, so no
transpose copy is ever made.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from trainfast.config import Augment, as_augment
from trainfast.data import augment as _augment
from trainfast.data.decode import jpeg_decoder_name
from trainfast.data.format import Pack, as_pack
from trainfast.errors import TrainfastError
from trainfast.hardware import resolve_device, usable_cores

RESIDENT_SHARE = 0.5
"""The share of the device's free memory a pack may take to be kept there (resident=None)."""
UPLOAD_CHUNK = 64 << 20  # bytes per host→device copy while uploading a pack


class _OnDevice:
    """A raw pack's images and labels on one device; shared by the Loaders of that pack there
    (a training and a held-out Loader over one pack upload it once)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels


_uploaded: weakref.WeakValueDictionary[tuple, _OnDevice] = weakref.WeakValueDictionary()

DECODE = ("auto", "cpu", "gpu")


class GoesOnWarning(UserWarning):
    """A loop over a Loader goes on from where an earlier loop was left (a break)."""


def gpu_jpeg_decoder(device: torch.device, channels: int):
    """A function list[uint8 byte tensors] → list[(C, H, W) uint8 on `device`]: torchvision's
    batched nvJPEG decode; None where it cannot run (not CUDA, no torchvision, one older than 0.20,
    which decodes one image per call)."""
    if device.type != "cuda":
        return None
    try:
        import torchvision
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as tv_decode
    except Exception:  # noqa: BLE001 - absent, or built for another torch: the CPU decodes
        return None
    try:
        if tuple(int(v) for v in torchvision.__version__.split("+")[0].split(".")[:2]) < (0, 20):
            return None
    except ValueError:  # a version string we cannot read: try it
        pass
    mode = ImageReadMode.GRAY if channels == 1 else ImageReadMode.RGB

    def decode(data: list[torch.Tensor]) -> list[torch.Tensor]:
        # NOTE: torchvision 0.28's batched decode on an H100 wrote into memory that work queued
        # on the caller's stream still read (corrupted batches). Waiting for that work first
        # costs a little overlap and rules it out.
        torch.cuda.current_stream(device).synchronize()
        return tv_decode(data, mode=mode, device=device)
    return decode


def free_memory(device: torch.device) -> int:
    """Bytes free on `device`: the CUDA driver's count, or available RAM on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def _upload(pack: Pack, device: torch.device) -> _OnDevice:
    """The pack's images and labels on `device`, copied once in chunks (no second host copy)."""
    key = (str(pack.path.resolve()), (pack.path / "images.npy").stat().st_mtime_ns, str(device))
    held = _uploaded.get(key)
    if held is None:
        src = pack.images
        images = torch.empty(src.shape, dtype=torch.uint8, device=device)
        step = max(1, UPLOAD_CHUNK // max(1, src[0].nbytes))
        for a in range(0, len(src), step):
            images[a: a + step].copy_(torch.from_numpy(np.array(src[a: a + step])))  # a writable chunk
        labels = torch.from_numpy(np.array(pack.labels)).to(device)
        held = _uploaded[key] = _OnDevice(images, labels)
    return held


def _subset(subset, n: int) -> np.ndarray:
    """Loader's subset as pack indices, each checked to be one of the pack's n images."""
    try:
        idx = np.asarray(subset)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is the argument's fault
        idx = np.asarray([None])
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise TrainfastError(f"Loader: subset must be a list of whole-number image indices, not {str(subset)[:80]}")
    idx = idx.astype(np.int64)
    bad = idx[(idx < 0) | (idx >= n)]
    if bad.size:
        raise TrainfastError(f"Loader: subset holds index {bad[0]}, outside the pack's {n:,} images "
                             f"(0 to {n - 1:,}){f'; {bad.size:,} such' if bad.size > 1 else ''}")
    return idx


class Loader:
    """An iterable of `(images, labels)` batches from a pack, on `device`.

    Args:
        pack: a Pack or the path of one.
        batch_size: images per batch (per process, under torchrun).
        shuffle: a fresh permutation each epoch, determined by (seed, epoch).
        drop_last: drop the last, smaller batch; defaults to `shuffle` (training).
        seed: seed of the order and of the augmentations.
        device: 'cpu', 'cuda', 'cuda:1', or None for cuda when available.
        dtype: float32 / bfloat16 / float16 in [0, 1] (normalised by the pack's mean and std
            when normalize=True), or torch.uint8 as stored (no conversion, no colour augment).
        normalize: subtract a per-channel mean and divide by the std: the pack's own (True),
            another pack's (a Pack, e.g. the training pack: held-out images are scored with the
            statistics the model trained with, as it will be used), or none (False).
        augment: an Augment config; geometric ones apply for uint8 output too.
        rank, world_size: this process's disjoint, equal share of each epoch (DDP).
        workers: gathering/decoding threads (default by what they do: see _default_workers).
        prefetch: batches prepared ahead (default: workers + 2).
        subset: draw only from these pack indices (e.g. a held-out split).
        decode: JPEG packs: "gpu" (batched nvJPEG; needs CUDA and torchvision ≥ 0.20), "cpu"
            (worker threads), or "auto": the GPU where it can, else the CPU.
        resident: keep the whole (raw) pack on the device and gather batches there. None:
            on CUDA when it takes at most RESIDENT_SHARE of the free device memory, off on
            the CPU (where the threaded host path measured as fast). True forces it (an
            error if it cannot be), False forces the host path.

    Images come as (B, C, H, W) in channels_last memory; labels as int64 (B,) or (B, L).
    `len(loader)` is batches per epoch. Each `for` over the loader runs one epoch and then
    moves to the next; a `for` left early (break) is followed by the rest of that epoch, with a
    warning that says so; `state_dict()` / `load_state_dict()` save and restore the position.
    """

    _pool: ThreadPoolExecutor | None = None
    _pool_pid = 0
    _COPY_AHEAD = True  # CUDA host path: copy on a side stream one batch ahead (False: in _finish)

    def __init__(self, pack, batch_size: int = 256, *, shuffle: bool = True, drop_last: bool | None = None,
                 seed: int = 0, device=None, dtype: torch.dtype = torch.float32, normalize: bool | Pack = True,
                 augment: Augment | None = None, rank: int = 0, world_size: int = 1,
                 workers: int | None = None, prefetch: int | None = None, subset=None,
                 resident: bool | None = None, decode: str = "auto"):
        self.pack = as_pack(pack, "Loader's pack")
        self.subset = None if subset is None else _subset(subset, len(self.pack))
        for arg, value, least in (("batch_size", batch_size, 1), ("workers", workers, 1), ("prefetch", prefetch, 1),
                                  ("rank", rank, 0), ("world_size", world_size, 1), ("seed", seed, 0)):
            if value is None and arg in ("workers", "prefetch"):  # None: the default
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise TrainfastError(f"Loader: {arg} must be a whole number ≥ {least}, not {value!r}")
        if not (world_size >= 1 and 0 <= rank < world_size):
            raise TrainfastError(f"rank {rank} is not in [0, world_size={world_size})")
        try:
            self.device = resolve_device(device)
        except ValueError as e:
            raise TrainfastError(str(e)) from None
        self.augment = as_augment(augment) or Augment()
        if dtype == torch.uint8 and (self.augment.brightness or self.augment.contrast or self.augment.cutout):
            raise TrainfastError("colour augmentations (brightness, contrast, cutout) need a float dtype, not uint8")
        if dtype not in (torch.uint8, torch.float32, torch.bfloat16, torch.float16):
            raise TrainfastError(f"dtype must be uint8, float32, bfloat16 or float16, not {dtype}")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = shuffle if drop_last is None else drop_last
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.dtype, self.normalize = dtype, normalize is not False
        self._float_dtype = torch.float32 if dtype == torch.uint8 else dtype
        self._gpu_decode = self._decoder(decode)
        self.workers = workers or self._default_workers()
        self.prefetch = prefetch or self.workers + 2
        self.epoch, self.position = 0, 0  # position: batches of this epoch already yielded
        self._left = False  # the last `for` was left before the epoch's end (a break)
        self._pin = self.device.type == "cuda"
        self._labels = np.array(self.pack.labels)  # small: keep in memory
        self._images = None if self.pack.images is None else np.asarray(self.pack.images)  # plain ndarray view
        h, w, c = self.pack.shape
        stats = normalize if isinstance(normalize, Pack) else self.pack
        if len(stats.mean) != c:
            raise TrainfastError(f"Loader: {stats.path} has {len(stats.mean)} channels, {self.pack.path} {c}: its "
                                 "statistics cannot normalise these images")
        mean = torch.tensor(stats.mean if normalize is not False else [0.0] * c, dtype=torch.float64)
        std = torch.tensor(stats.std if normalize is not False else [1.0] * c, dtype=torch.float64)
        # NOTE: the affine maps act on the NHWC batch viewed as rows of W*C values, with the
        # per-channel constants tiled W times. Broadcasting (1, C, 1, 1) over channels_last
        # memory (C = 3 innermost) was 4× slower here.
        self._rows = {  # x = shift + u8 * scale = (u8 / 255 - mean) / std
            "scale": (1 / (255 * std)).repeat(w).to(self.device, self._float_dtype),
            "shift": (-mean / std).repeat(w).to(self.device, self._float_dtype),
            "inv_std": (1 / std).repeat(w).to(self.device, self._float_dtype),
        }
        self._on_device = self._resident(resident)
        if self.samples_per_rank == 0 or len(self) == 0:
            raise TrainfastError(f"{self.pack.path}: {self.samples} images are too few for batch_size "
                                 f"{batch_size} × world_size {world_size} with drop_last")

    def _resident(self, want: bool | None) -> _OnDevice | None:
        if want is False or (want is None and self.device.type != "cuda"):
            return None
        why = None
        if self.pack.encoding != "raw":
            why = f"it is a {self.pack.encoding} pack (only raw packs are kept whole on the device)"
        else:
            need, free = self.pack.images.nbytes, free_memory(self.device)
            limit = free if want else RESIDENT_SHARE * free
            if need > limit:
                why = f"it needs {need / 2**30:.2f} GiB and {self.device} has {free / 2**30:.2f} GiB free"
        if why:
            if want:
                raise TrainfastError(f"{self.pack.path}: resident=True, but the pack cannot be kept on {self.device}: {why}")
            return None
        return _upload(self.pack, self.device)

    def _default_workers(self) -> int:
        """Threads by what they do. Measured on an H200 with 16 cores (40,000 images of
        64×128×3, batch 256; 512² JPEG, batch 32): a raw pack's gather to CUDA ran at
        260k / 470k / 775k / 565k images/s with 2 / 4 / 8 / 16 threads (the pinned copy limit is
        2.1M); with GPU decode the threads only slice bytes, and 4 fed 16,500 images/s where 16
        fed 11,200 (they contend with the decoding thread). On the CPU 2 gather threads keep up
        with any model; CPU JPEG decode takes every core."""
        cores = usable_cores()
        if self.pack.encoding == "raw":
            return min(cores, 8) if self.device.type == "cuda" else 2
        return min(cores, 4) if self._gpu_decode is not None else cores

    def _decoder(self, want: str):
        """The batched GPU decode function, or None for worker-thread decoding (or a raw pack)."""
        if want not in DECODE:
            raise TrainfastError(f"decode must be one of {', '.join(DECODE)}, not {want!r}")
        if self.pack.encoding != "jpeg" or want == "cpu":
            return None
        fn = gpu_jpeg_decoder(self.device, self.pack.shape[2])
        if fn is None and want == "gpu":
            raise TrainfastError(f"{self.pack.path}: decode='gpu' needs a CUDA device and torchvision ≥ 0.20 "
                                 f"(pip install 'trainfast[gpu]'); the device is {self.device}")
        return fn

    def describe(self) -> str:
        """How batches reach the device, in words (the doctor's report and speed.json name it)."""
        if self.resident:
            return f"raw pack kept on {self.device}"
        if self._gpu_decode is not None:
            return f"JPEG decoded on {self.device} (nvJPEG, batched)"
        how = f"JPEG decoded by {self.workers} threads ({jpeg_decoder_name()})" if self.pack.encoding == "jpeg" \
            else f"raw pack gathered by {self.workers} threads"
        return how + (", copied on a side stream" if self._pin else "")

    @property
    def decodes_on_device(self) -> bool:
        """Whether a JPEG pack's batches are decoded on the device (batched nvJPEG)."""
        return self._gpu_decode is not None

    @property
    def resident(self) -> bool:
        """Whether batches are gathered from a copy of the pack on the device."""
        return self._on_device is not None

    # -- order --------------------------------------------------------------------------------

    @property
    def samples(self) -> int:
        """Images this loader draws from (all ranks together)."""
        return len(self.pack) if self.subset is None else len(self.subset)

    @property
    def samples_per_rank(self) -> int:
        return self.samples // self.world_size

    def __len__(self) -> int:
        n, b = self.samples_per_rank, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's pack indices for `epoch`, in order (a pure function of seed and epoch).

        Rank r takes every world_size-th index from position r, so the k-th batches of all
        ranks together are the k-th batch of one process with world_size × batch_size.
        """
        n = self.samples
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        if self.subset is not None:
            order = self.subset[order]
        return order[self.rank:: self.world_size][: self.samples_per_rank]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        epoch, position = state.get("epoch"), state.get("position")
        for name, value in (("epoch", epoch), ("position", position)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise TrainfastError(f"Loader.load_state_dict: {name} must be a whole number ≥ 0, not {value!r}")
        if position > len(self):
            raise TrainfastError(f"Loader.load_state_dict: position {position} is past this epoch's {len(self)} "
                                 f"batches (saved with another batch size or pack?)")
        self.epoch, self.position = int(epoch), int(position)
        self._left = False  # the next `for` resumes at this position

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.position, self._left = epoch, 0, False

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self):
        if self._left:  # a `for` after one that was left (a break): said once, not silently
            warnings.warn(f"this Loader's last loop stopped at batch {self.position} of {len(self)} in epoch "
                          f"{self.epoch}; this loop goes on from there (loader.set_epoch({self.epoch}) starts the "
                          "epoch over)", GoesOnWarning, stacklevel=2)
            self._left = False
        epoch, start = self.epoch, self.position
        idx = self.indices(epoch)
        batches = self._resident_batches(idx, start) if self.resident else self._host_batches(idx, start)
        done = False
        try:
            for k, (images, labels) in enumerate(batches, start):
                out = self._finish(images, labels, epoch, k)
                self.position = k + 1
                yield out
            done = True
        finally:
            self._left = not done
        self.epoch, self.position = epoch + 1, 0

    def _resident_batches(self, idx: np.ndarray, start: int):
        """uint8 NHWC batches gathered on the device from the resident pack."""
        b, held = self.batch_size, self._on_device
        order = torch.from_numpy(idx).to(self.device)  # one small copy per epoch
        for k in range(start, len(self)):
            sel = order[k * b: (k + 1) * b]
            yield held.images.index_select(0, sel), held.labels.index_select(0, sel)

    def _host_batches(self, idx: np.ndarray, start: int):
        """uint8 NHWC batches gathered by worker threads; on CUDA copied to the device on a side
        stream one batch ahead of the one yielded."""
        b = self.batch_size
        jobs = (idx[k * b: (k + 1) * b] for k in range(start, len(self)))
        if self._pool is None or self._pool_pid != os.getpid():
            # NOTE: a fork()ed child inherits the pool but not its threads: work submitted there
            # would wait for ever. The child makes its own.
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="trainfast-loader")
            self._pool_pid = os.getpid()
        inflight: deque = deque()
        ahead = None  # CUDA: the next batch, its copy queued on the side stream
        try:
            for _ in range(start, len(self)):
                while len(inflight) < self.prefetch:
                    batch = next(jobs, None)
                    if batch is None:
                        break
                    inflight.append(self._pool.submit(self._gather, batch))
                host = inflight.popleft().result()
                if self._gpu_decode is not None:
                    yield self._decode_on_device(*host)
                    continue
                if not self._pin or not self._COPY_AHEAD:
                    yield host
                    continue
                staged, ahead = ahead, self._copy_ahead(*host)
                if staged is not None:
                    yield self._arrived(*staged)
            if ahead is not None:
                yield self._arrived(*ahead)
        finally:
            for f in inflight:
                f.cancel()

    def _decode_on_device(self, data: list, labels: torch.Tensor):
        """One batched decode of the batch's JPEG bytes → uint8 (B, H, W, C) on the device."""
        h, w, c = self.pack.shape
        images = self._gpu_decode(data)
        bad = next((i for i, im in enumerate(images) if tuple(im.shape) != (c, h, w)), None)
        if bad is not None:
            raise TrainfastError(f"{self.pack.path}: an image decoded to {tuple(images[bad].shape)}, "
                                 f"not {(c, h, w)}: damaged pack")
        return torch.stack(images).permute(0, 2, 3, 1).contiguous(), labels.to(self.device)

    def _copy_ahead(self, images: torch.Tensor, labels: torch.Tensor):
        """Queue the copy of a pinned batch on the side stream; the event marks its end. The pinned
        block is reused (torch's caching host allocator) only after that copy has run."""
        if getattr(self, "_stream", None) is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            x = images.to(self.device, non_blocking=True)
            y = labels.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return x, y, done

    def _arrived(self, x: torch.Tensor, y: torch.Tensor, done):
        """Make the consumer's stream wait for the copy, and tell the allocator who uses the memory."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        x.record_stream(stream)
        y.record_stream(stream)
        return x, y

    def batch(self, k: int, epoch: int | None = None):
        """The k-th batch of `epoch` (default: the current one), made now in this thread: the same
        images, labels and augmentations as the k-th batch that iterating yields. For random
        access, e.g. trainfast.keras.PackDataset."""
        epoch = self.epoch if epoch is None else epoch
        if not 0 <= k < len(self):
            raise IndexError(f"batch {k} is out of range for {len(self)} batches")
        if getattr(self, "_order", (None,))[0] != epoch:  # one permutation per epoch, not per batch
            self._order = (epoch, self.indices(epoch))
        idx = self._order[1][self.batch_size * k: self.batch_size * (k + 1)]
        if self.resident:
            return self._finish(*next(self._resident_batches(idx, 0)), epoch, k)
        host = self._gather(idx)
        return self._finish(*(self._decode_on_device(*host) if self._gpu_decode is not None else host), epoch, k)

    def _gather(self, idx: np.ndarray):
        """Host side of one batch (runs in a worker thread): uint8 (B, H, W, C) + labels; for
        GPU decode, each image's JPEG bytes instead."""
        h, w, c = self.pack.shape
        if self._gpu_decode is not None:
            jpeg, offsets = self.pack.jpeg, self.pack.offsets
            data = [torch.from_numpy(np.array(jpeg[offsets[i]: offsets[i + 1]])) for i in idx]
            return data, torch.from_numpy(self._labels[idx])
        if self._images is not None and not self._pin:
            # NOTE: a fresh numpy array, not torch.empty: numpy asks for huge pages on large
            # allocations, which made this gather 8× faster than into 4 KiB-paged memory.
            images = torch.from_numpy(np.take(self._images, idx, axis=0))
        else:
            images = torch.empty((len(idx), h, w, c), dtype=torch.uint8, pin_memory=self._pin)
            out = images.numpy()
            if self._images is not None:
                np.take(self._images, idx, axis=0, out=out)
            else:
                for j, i in enumerate(idx):
                    out[j] = self.pack.image(i)  # a damaged image: one line naming the pack
        labels = torch.from_numpy(self._labels[idx])
        return images, (labels.pin_memory() if self._pin else labels)

    def _generator(self, epoch: int, k: int) -> torch.Generator:
        g = torch.Generator()  # on the CPU whatever the device: the same augmentations everywhere
        g.manual_seed(int(np.random.SeedSequence([self.seed, self.rank, epoch, k]).generate_state(1)[0]))
        return g

    def _finish(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, k: int):
        """Device side of one batch: copy (unless there already), augment, convert (runs in the
        consumer's thread)."""
        x = images.to(self.device, non_blocking=True)
        y = labels.to(self.device, non_blocking=True)
        aug = self.augment
        g = self._generator(epoch, k) if aug.active else None
        if aug.geometric:
            x = _augment.geometric(x, aug, g)
        if self.dtype == torch.uint8:
            return x.permute(0, 3, 1, 2), y  # (B, C, H, W) view of NHWC memory: channels_last
        b, h, w, c = x.shape
        rows, r = x.view(b * h, w * c), self._rows
        if aug.brightness or aug.contrast or aug.cutout:
            f = rows.to(self.dtype).mul_(1 / 255)
            _augment.photometric(f.view(b, h, w, c).permute(0, 3, 1, 2), aug, g)  # in place
            f.mul_(r["inv_std"]).add_(r["shift"])  # (f - mean) / std
        else:
            f = torch.addcmul(r["shift"], rows, r["scale"])
        return f.view(b, h, w, c).permute(0, 3, 1, 2), y

    def __del__(self):
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=False, cancel_futures=True)
