"""Keras 3 users keep Keras (any backend): read a pack at memory speed, see where a fit's time
goes, and measure which of Keras's own speed settings win on this machine.

    from trainfast.keras import PackDataset, SpeedDoctor, tune
    data = PackDataset("plates.pack", batch_size=128)
    print(tune(model, data))           # precision policy, jit_compile, steps_per_execution, batch
    model.fit(data, epochs=10, callbacks=[SpeedDoctor()])

Optional: needs `pip install keras` (Keras 3) and one of its backends (tensorflow, jax or torch).
Rooms: data (PackDataset), settings (tune), doctor (SpeedDoctor, and the Keras side of the
script doctor). This package imports diagnose; diagnose never imports it.
"""

try:
    import keras
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError("trainfast.keras needs Keras 3 and a backend: pip install keras tensorflow "
                      "(or keras with jax or torch; set KERAS_BACKEND)") from None
if int(keras.__version__.split(".")[0]) < 3:  # pragma: no cover
    raise ImportError(f"trainfast.keras needs Keras 3, not {keras.__version__}: pip install -U keras")

from trainfast.keras.data import PackDataset  # noqa: E402
from trainfast.keras.doctor import SpeedDoctor  # noqa: E402
from trainfast.keras.settings import KerasSetting, KerasTrial, KerasTuneResult, batch_ends, tune  # noqa: E402

__all__ = ["KerasSetting", "KerasTrial", "KerasTuneResult", "PackDataset", "SpeedDoctor", "batch_ends", "tune"]
