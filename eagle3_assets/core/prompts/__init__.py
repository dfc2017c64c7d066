"""prompts: a dataset source (messages, ShareGPT or instruction rows; JSONL, JSON or Parquet) as chat prompts
with stable ids; rows that cannot be used are quarantined with their reason (`reading` bounds what a row may
hold, `ingest` normalises, `context` refuses prompts the target cannot hold). May import: storage,
target_model.
"""
