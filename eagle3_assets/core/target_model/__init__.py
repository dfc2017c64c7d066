"""target_model: the target model, its tokenizer and chat template, loaded and cached once per process.

`loading` finds and caches the model and tokenizer (the embedded SmolLM2 included); `chat` rebuilds the exact
ids and loss mask of a conversation with the template, from a plan per conversation shape (`template_plan`)
cut from the template's sentinel rendering (`template_render`), rebuilding rows the template rewrites
(`rewrites`); `verbatim` proves once per template that it writes texts unchanged; `text_encoder` encodes text
without matching special tokens inside it. Shared by every stage after prompts.
May import: storage.
"""
