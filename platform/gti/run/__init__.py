"""The run folder: what a run is on disk, and the machinery that writes and reads it.

`pipeline` (the stage list, fingerprints, atomic stage folders), `contract` (what a stage gets
and gives back), `manifest` (each stage folder's `_manifest.json`, fingerprints), `runlock`
(one writer per folder), `versions` (which model and SID map are current), `loaded` (a trained
run loaded for decoding), `chunked_output` (a stage's resumable output), `input_files` (the
fingerprint of the user's input files).

What it does not know: what any stage computes; it imports no stage and no Ray.
"""
