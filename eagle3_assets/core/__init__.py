"""The plain-Python core of the pipeline, one package per stage; no Dagster import anywhere below this
package.

Stages, in the order data flows, each importing only the ones listed before it (and `eagle3_assets.config`):

    storage        paths of a partition, crash-safe files, append-only tables, object stores, data versions,
                   the HTTP proxy of every outbound request
    target_model   the target model, its tokenizer and chat template, its context (shared by every stage)
    prompts        dataset sources -> chat prompts with stable ids, bad rows and over-long prompts quarantined
    generation     the engine that answers prompts through any backend: budget, journal, limiter, imports
    tokens         answered conversations -> input_ids + loss_mask, checked against the ids the model produced
    report         per-dataset statistics and the rules of the asset checks
    hidden_states  the target's aux hidden states in packed shards, their checks, the trainers' exports
    acceptance     a small EAGLE-3 draft trained on a partition and measured against the target
    data_value     drafts per dataset (on all, on all but each) on a common held-out suite, priced

`tests/test_layering.py` holds every module to this order.
"""
