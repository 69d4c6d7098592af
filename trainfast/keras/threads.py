"""How many CPU threads Keras's backend trains with, how to change it, and the line that does it
in a user's script: the cores answer for Keras.

The torch backend's intra-op pool can be resized at any moment (torch.set_num_threads), so
`tune` times fewer threads on a copy of the model. TensorFlow fixes its pools when it first
runs an op: in a running process the count can only be read, and the line to change it goes at
the top of the script (tf.config.threading.*). JAX's CPU threads are set by XLA flags before
it starts: read and said, not timed.
"""

from __future__ import annotations

import contextlib

import keras
import torch

from trainfast import hardware


def current() -> int | None:
    """The intra-op threads the backend trains with now (TensorFlow's default, 0, read as the
    usable cores it then takes), or None where it cannot be read."""
    backend = keras.backend.backend()
    if backend == "torch":
        return torch.get_num_threads()
    if backend == "tensorflow":
        import tensorflow as tf
        return tf.config.threading.get_intra_op_parallelism_threads() or hardware.usable_cores()
    return None


def can_time() -> bool:
    """Whether a trial may run with another thread count in this process."""
    return keras.backend.backend() == "torch"


@contextlib.contextmanager
def using(threads: int | None):
    """Run the block with `threads` intra-op threads (None: as they are); torch backend only."""
    if threads is None or not can_time():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def code(threads: int) -> str:
    """The line(s) that make the user's script train with `threads` threads on its backend."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return (f"tf.config.threading.set_intra_op_parallelism_threads({threads})   # at the top of the script, "
                "before TensorFlow runs anything\n"
                "tf.config.threading.set_inter_op_parallelism_threads(1)   # one op at a time: a CNN's ops run "
                "one after another")
    if backend == "jax":
        return (f'os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false '
                f'intra_op_parallelism_threads={threads}"   # before importing jax or keras')
    return f"torch.set_num_threads({threads})   # Keras's torch backend: at the top of the script"
