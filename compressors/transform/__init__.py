"""Transform coders fitted on calibration text: KVTC (PCA + bit allocation), AQUA-KV (cross-layer prediction)."""
