"""`gti refresh`: new items onto a trained run, without retraining it.

What it is for: a catalog gains items after a run has trained. `refresh(run_dir, items,
interactions)` gives them SIDs made of the run's existing code tokens (plus a few added ones
where a prefix group is full: `refresh.on_full_group: add_tokens`, the default), teaches the model what
they mean with a short grounding pass, and writes a new SID-map version that descends from the
run's (so evaluation and `gti recommend` accept it for the old model as well as for the new):

1. ingest (`gti.refresh.ingest`): the new items (and optional new interactions) are read and
   validated with the ingest stage's own readers and row checks (`gti.data.batches`,
   `gti.data.items.ingest_items`: same formats, same column mapping `data.items.*` /
   `data.interactions.*`, overridable with key=value). Bad rows go to
   `ingest/items_quarantine.parquet` / `interactions_quarantine.parquet` with their reason,
   file and row; an interaction naming an item that is neither in the run's map nor new is
   `unknown_item`. New interactions are merged with the parent's (each user's history in time
   order) into `ingest/sequences.parquet`, split as the run's `data.split`: leave-one-out, or
   global_time by the run's ingest cuts (`facts.split.cut_ts`; old rows keep their periods; a
   run without them is refused). `data.max_items` and `data.max_users` do not apply to a refresh.
2. embed (`gti.refresh.new_items`, as 3 and 5): the run's encoder (`embed` section;
   `gti.embed.encoders`), in this process.
3. assign: the run's frozen quantiser (`<run>/sid/quantizer.*`, `gti.sid.quantizer.load_quantizer`)
   gives the codes; `gti.sid.map_edits.assign_new_items` resolves collisions against the parent
   map (with the parent version's codebook sizes) without changing any existing SID (the
   de-duplication level takes the smallest free code of the prefix group). Items that would
   need a new token (a full prefix group) are listed in `needs_new_tokens.json`. With
   `refresh.on_full_group: add_tokens` (the default: bench/refresh/full_group.py measured it
   against moving them to the nearest group with a free code),
   `gti.sid.map_edits.add_last_level_codes` grows the last level by as many codes as the
   fullest group needs and puts those items on them (old SIDs still unchanged); with `error`
   the refresh stops with one line instead. The new
   map is written with its version record (parent hash, codebook sizes, grown or not) and added
   to `<run>/refresh/lineage/`; a grown map still descends from its parent
   (`gti.sid.versions.identity_problem`), but a model whose vocabulary lacks the added tokens
   (the parent's) refuses it with one line naming them (`MissingSidTokensError`).
4. tokens (`gti.refresh.tokens`, only when codes were added): the parent's model and tokenizer
   get one token per added code, appended after the tokenizer's last token, each row (input,
   and untied head) the mean of the last level's existing rows (where mean initialisation
   would put it) -> `<work>/grown_model/`, whose `gti_meta.json` `new_token_ids` covers them.
   Every later step starts from it.
5. pairs: the new items' grounding pairs (the pairs stage's renderer `gti.lm.pairs.RenderPairs`,
   same templates, the new map's codec and that model's tokenizer), plus
   `refresh.replay_ratio` x as many old training pairs (seeded sample of the run's pairs and
   earlier refreshes' new pairs).
6. ground (`gti.refresh.train`, as 7): `refresh.ground_steps` steps of the grounding task on Ray Train + DeepSpeed
   (`gti.train.ground_run.run_grounding`, the grounding task: backbone and every non-SID row
   frozen, only the SID rows train, the added ones included), continuing from the parent's model (the latest
   refresh's, else `<run>/sft/model`, else `<run>/ground/model`; with the added tokens when
   step 4 made them). Validation: constrained text->SID exact match on the new items
   (held-out pairs when the split has them, else in-sample). With `refresh.ground_steps: 0`
   nothing trains: the exported model is the parent's, with any added tokens at their
   level's mean rows (usable, untrained for those tokens).
7. sft (optional, `refresh.sft_steps` > 0, needs `--interactions`): the SFT task on the
   training windows of the users the new interactions touch, plus `refresh.sft_replay_ratio`
   x as many windows of other users (0 by default).
8. export (`gti.refresh.command`, which also orders the steps): `model/` (standard HF folder;
   `gti_meta.json` records `sid_map_hash` = the new map, `sid_map_parent`, `sid_map_version`,
   `codebook_sizes`), `_manifest.json` (facts: parent and new hash, counts, `codebook_sizes`,
   `added_tokens`, steps, wall time of each step) and `config.yaml`. `gti recommend --version k`
   and evaluation spell the map with its version record's sizes
   (`gti.run.loaded.map_codec`).

Output: `<run>/refresh/v<k>/` (k = 1, 2, ..., after the highest published one; layout in
`gti.run.versions`). Each version's manifest records the base it was made on (`facts.base`: the
run's model stage, its manifest fingerprint and time, the sid map hash; see
`gti.run.versions.base_record`): after `gti run --force` or a config change retrains the run,
older versions are skipped with one line, and the next refresh starts from the new base.
`model.trust_remote_code` comes from `--trust-remote-code` only, never from the run's config. The work happens in
`<run>/refresh/.v<k>.partial/`; a rerun of the same command (same inputs and settings) reuses
it: finished steps are skipped and grounding/SFT resume from their last Ray Train checkpoint.

Modules: `attempt` (the `Job` every step gets: run, config, parent version, work folder;
`RefreshError`, `RefreshResult`, `load_run_config`), `ingest`, `new_items`, `tokens`, `train` (the steps) and
`command` (`refresh`, `cli_main`, the export step, resuming and publishing a version).

Ray: only through `gti.ray_start.ensure_ray` and the training runners
`gti.train.ground_run.run_grounding` / `gti.train.sft_run.run_sft` (the ones the `ground` and
`sft` stages use; this package is a driver, like `gti.vocab_ground`). It imports no stage
module: it reads with what the ingest stage reads with, the readers of `gti.data.batches`
(`Source`, `local_stream`, `iterate`, `raise_file_error`, `fill_interaction_raw`) and the items
pass `gti.data.items.ingest_items`; the output schemas (`INTER_Q_SCHEMA`, `PAIRS_SCHEMA`, ...)
are `gti.data.schemas`', the input files' fingerprint `gti.run.input_files.fingerprint_files`, the pair
renderer `gti.lm.pairs.RenderPairs`; the validation set (`write_val_set`, `VAL_TASKS`) comes
from `gti.train.ground_run`, `rebuild_trained` from `gti.train.sft_task`.

What it does not know: how the run's stages were run (it reads their manifests and outputs).
"""
