"""The offline pipeline, whose output a bundle keeps: the calibration corpus, profiling and
thresholds (`profile`), predictor training (`train`), the GPU/CPU placement (`solver`),
evaluation, reports, and synthetic models of real shapes."""
