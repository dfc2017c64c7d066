"""Export packed hidden-state shards to the layouts training frameworks read, with the files each needs
beside.

Every layout was checked by running the framework's own code on it (tests/consumers/: speculators 0.9.0,
SpecForge 0.2.0, Model-Optimizer 0.47.0, each in its own environment). One module per layout
(`speculators.py`, `specforge.py`, `modelopt.py`), each an `ExportFormat` (`base.py`) that writes the
samples and its side files; `export.py` runs one export with the machinery they share: the samples in
export order, cut to `max_len` (`samples.py`), the layer ids and the manifest (`manifest.py`) and what the
side files need of the target (`target.py`).

FP8 shards (`hidden_states.storage_dtype: float8_e4m3fn`): the speculators export keeps FP8, as
hs-connectors' `FP8Transfer` (speculators' `--hidden-states-backend fp8`) reads it: `hidden_states` float8
[S, 4, H] with `hidden_states_scales` float32 [S, 4, 1] beside it (one scale per token and layer, as
stored). SpecForge and Model-Optimizer read no FP8: their exports hold the dequantized states in bf16, and
the manifest says so (`dtype`, `source_dtype`, `dequantized`).

Every export also writes `manifest.json` (target model, revision, layer ids in the consumer's convention,
dtype, sample and token counts, the training command) and `eagle3_config.json` (the layer ids alone), so
that a consumer can refuse data for another target. Samples are written in the order of a hash of their id:
speculators holds out the last tenth of the rows for validation, and the shards are ordered by length. A
sample left with no trained token (by a `max_len` cut) is left out and counted, and an export left with
none is refused before anything is written (`samples.plan_samples`).

An export is built in a temporary folder beside `out` and swapped in whole, so a re-export never leaves
files of an earlier one behind (Model-Optimizer would read a stale `*.pt` as a sample) and a crash leaves
the previous export.

Layer ids: `hidden_states.aux_layers` counts outputs of decoder layers, 0-based. SpecForge (through SGLang,
which captures the input of layer id + 1) and Model-Optimizer (forward hooks on layer outputs) use that
convention; vLLM and speculators count `output_hidden_states` indices, so their ids are ours + 1
(`layer_ids.py`).
"""
