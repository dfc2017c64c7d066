"""generation: the target's answers to every prompt, exactly once, within a budget, through any backend.

`run` plans a dataset's generation and drives `engine` (adaptive concurrency from `limiter`, hard budgets from
`budget`, retries by the error classes of `protocol`); every attempt goes to the dispatch `ledger` before it
is sent and every answer to the `journal`; `importer` brings in answers produced elsewhere; `topup` says
whether a dataset has work left. May import: storage, target_model, prompts.
"""
