"""data_value: what each dataset buys. Drafts per dataset, on all and on all but each, measured on a common
held-out suite beside the dollars, tokens and GPU-seconds their data cost. May import: every stage before it.
"""
