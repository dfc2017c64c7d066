"""report: per-dataset statistics (report.json, report.md) and the rules behind the asset checks, as plain
functions over the stored tables. May import: storage, target_model, generation, tokens.
"""
