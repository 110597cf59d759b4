"""Small services every layer may use: errors, atomic file writes, redaction, progress, timing,
tracking, the device probe, streaming parquet, arm names and the command ledger.

Each module stands alone: none imports Ray, the config or the run folder; the only import
between them is `errors` (and `redact` for the modules that print user strings).
"""
