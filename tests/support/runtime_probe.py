"""Run inside the runtime environment (tests/support/runtime_install.py): load every shipped recipe as a
deployment would, build its definitions and load its target's tokenizer through the project's own path
(`resources.Target`: the chat tokenizer, preflight's special-token rules, a tokenized answer with reasoning).

    python runtime_probe.py KIMI_FOLDER RECIPE...

Hub targets (Kimi-K2.5) are replaced by the local folder KIMI_FOLDER, the Kimi-shaped stand-in of
tests/support/kimi_standin (tiktoken and remote code, like the real one): nothing here reaches the hub. Prints
one JSON object; exits non-zero with the error if a recipe does not load.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path


def probe(recipe: Path, kimi: str) -> dict[str, object]:
    from eagle3_assets.config import load_config
    from eagle3_assets.core.target_model.chat import Answer
    from eagle3_assets.core.target_model.loading import is_hub_reference
    from eagle3_assets.core.target_model.preflight import special_token_problems
    from eagle3_assets.definitions import build_definitions
    from resources import Target

    cfg = load_config(recipe)
    defs = build_definitions(cfg, str(recipe))  # the executor it names, k8s included
    target = cfg.target
    if is_hub_reference(target.tokenizer, cfg.base_dir):
        # The stand-in is a local copy: nothing from the hub, no revision to pin (no weights are read).
        target = target.model_copy(update={"tokenizer": kimi, "model": kimi, "revision": None})
        cfg = cfg.model_copy(update={"target": target})
    chat = Target(cfg).chat_tokenizer()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    tokens = chat.tokenize([(messages, Answer("It is 4.", "Add two and two.", True))])[0]
    return {
        "executor": defs.resolve_job_def("training_data").executor_def.name,
        "tokenizer": type(chat.tok).__name__,
        "remote_code": target.trust_remote_code,
        "ids": len(tokens.input_ids),
        "special_tokens": special_token_problems(chat, target.end_of_turn_id),
    }


def main() -> int:
    kimi, recipes = sys.argv[1], [Path(p) for p in sys.argv[2:]]
    requires = importlib.metadata.requires("eagle3-assets") or []
    out = {
        "unconditional_requirements": [r for r in requires if "extra ==" not in r],
        "recipes": {str(r): probe(r, kimi) for r in recipes},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
