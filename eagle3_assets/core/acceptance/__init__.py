"""acceptance: a small EAGLE-3 draft trained on a partition's hidden states and measured against the target by
speculative decoding, and the gate's verdict. May import: storage, target_model, tokens, report,
hidden_states.
"""
