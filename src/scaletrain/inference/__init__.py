"""Using a trained model: loading it from its run folder (checkpoint.py), what it scores (inputs.py), scoring on
any number of processes and writing submissions and reports (predict.py), and exporting it for serving
(export.py)."""
