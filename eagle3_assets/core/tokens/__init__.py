"""tokens: every answered conversation as input_ids + loss_mask (the target's chat template rebuilt exactly),
built incrementally and compared with the ids the model really produced. May import: storage, target_model,
generation.
"""
