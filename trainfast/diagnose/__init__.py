"""`trainfast doctor`: where the training time goes, why, and what to do — with numbers.

    report = trainfast.doctor("plate_cnn", "plates/labels.csv", batch_size=128,
                              source_options={"label_column": "plate"})
    print(report.text())

Rooms: checkup (the doctor on a model and its data: measure, verdict, fixes timed), cost
(per-layer parameters and FLOPs), timing (the step in stages), verdict (the rules), report
(text, JSON, HTML), storage (where the files live), probes + script (a user's own script,
unedited), recipe (the pack that replaces a script's per-image pipeline).
"""

from trainfast.diagnose.checkup import SCHEMA_VERSION, Report, doctor, load_model

__all__ = ["SCHEMA_VERSION", "Report", "doctor", "load_model"]

doctor.__module__ = __name__  # the public path (trainfast.diagnose.doctor), as users and reprs name it
