"""Do `target.tokenizer` and `target.model` belong together? Answers come back as text and are tokenized with
the tokenizer; hidden states and the acceptance gate run the model on those ids. A tokenizer of another family
gives ids the model reads as other tokens (or has no embedding row for): every stored state is then wrong, and
nothing downstream notices. So preflight compares, before anything is paid for:

- the model's config files, read as JSON (no weights, no remote code, never downloaded): the tokenizer's ids
  must fit the model's `vocab_size` (more rows than ids is padding, fine), and the
  `bos_token_id`/`eos_token_id` the config states must be the tokenizer's id of that role or one of its
  control tokens (special or added), not an ordinary text token nor an id past its vocabulary. `pad_token_id`
  is held to the same rule as a warning only: nothing here feeds padding to the model. Where tokenizer and
  model are the same checkpoint, a disagreement of its own files is a warning too (it is what the checkpoint
  ships), but ids past the model's rows stay fatal;
- each vLLM server that extracts hidden states (`hidden_states.engine: vllm`), through its `/tokenize`: the
  server's ids of a probe text must be ours (fatal), and its rendering of a chat the same as our template's (a
  warning: the extraction sends ids, so only the template differs).

A check that cannot run (no config on this machine, a server down) is a warning that says so, never a pass.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ...config import ProjectConfig, TargetConfig
from ..storage.proxy import urlopen
from .loading import cache_root, is_hub_reference, load_tokenizer, pin_problems, resolve, tokenizer_files_key

PAIRING_FIX = (
    "set target.model to the checkpoint of the tokenizer's model, or target.tokenizer to the model's "
    "tokenizer"
)
SERVER_FIX = (
    "serve the checkpoint of target.tokenizer's model (`eagle3 vllm-serve` prints the command), or set "
    "target.tokenizer to the served model's tokenizer"
)
CONFIG_FILES = ("config.json", "generation_config.json")
STRICT_ROLES = ("bos", "eos")  # a wrong one ends or opens sequences with another family's token
SOFT_ROLES = ("pad",)
PROBE_TEXT = "Hello, world! 12345 naïve café 東京\n\tdef f(x):\n        return x ** 2  # ok?"
PROBE_CHAT = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Name a city."},
]
# More embedding rows than tokenizer ids is padding (to a multiple of 64..1024, a few hundred rows at most);
# far more suggests a larger family's model.
PADDING_ROWS_SLACK = 1024
SERVER_TIMEOUT_S = 5.0


@dataclass
class PairingReport:
    problems: list[str] = field(default_factory=list)  # fatal: nothing is sent
    warnings: list[str] = field(default_factory=list)  # reported; includes every check that could not run

    def add(self, other: PairingReport) -> PairingReport:
        self.problems += other.problems
        self.warnings += other.warnings
        return self


@dataclass(frozen=True)
class StatedId:
    """One special id a model's config files state, with where it was read."""

    where: str  # e.g. "config.json text_config.eos_token_id"
    role: str  # bos | eos | pad
    id: int


@dataclass(frozen=True)
class ModelIds:
    """What a checkpoint's config files say about token ids."""

    vocab_size: int | None
    vocab_where: str
    stated: tuple[StatedId, ...]


@dataclass(frozen=True)
class TokenizerIds:
    """The ids a tokenizer can produce, its role ids and its control tokens (special or added)."""

    size: int  # len(tokenizer)
    top: int  # the highest id it can produce
    roles: dict[str, int | None]
    control: frozenset[int]
    known: frozenset[int]  # every id with a token (a vocabulary may have holes)
    describe: Callable[[int], str]

    @property
    def span(self) -> int:
        return max(self.size, self.top + 1)


# -- the model's config, as files on this machine ------------------------------------------------------------
def model_config_files(target: TargetConfig, base_dir: str | Path) -> tuple[dict[str, Path], str | None]:
    """The model's config files found without downloading (a local folder, or the Hugging Face cache at
    target.revision), or why none were: ({}, reason)."""
    ref = resolve(target.model, base_dir)
    if Path(ref).is_dir():
        found = {n: Path(ref) / n for n in CONFIG_FILES if (Path(ref) / n).is_file()}
        return (found, None) if "config.json" in found else ({}, f"the folder {ref} has no config.json")
    if not is_hub_reference(target.model, base_dir):
        return {}, f"{ref} is not a folder"
    found = {}
    for name in CONFIG_FILES:
        path = _cached_hub_file(ref, name, target.revision)
        if path is not None:
            found[name] = path
    if "config.json" not in found:
        rev = f" --revision {target.revision}" if target.revision else ""
        return {}, (
            f"{ref} is not a folder on this machine and its config.json is not in the Hugging Face cache "
            f"(preflight downloads nothing; `hf download {ref} {' '.join(CONFIG_FILES)}{rev}` puts it there)"
        )
    return found, None


def _cached_hub_file(repo: str, name: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(repo, name, revision=revision)
    except Exception:  # not a valid repo id, no hub client: not on this machine
        return None
    return Path(path) if isinstance(path, str) else None


def read_model_ids(files: dict[str, Path]) -> ModelIds:
    """vocab_size (text_config's for a multimodal config) and the special ids stated at either level of
    config.json and in generation_config.json (`eos_token_id` may be a list); one entry per role and id."""
    vocab, vocab_where = None, "config.json"
    stated: dict[tuple[str, int], list[str]] = {}
    for name, path in files.items():
        data = json.loads(path.read_text(encoding="utf-8"))
        levels = [("", data)]
        if isinstance(data.get("text_config"), dict):
            levels.insert(0, ("text_config.", data["text_config"]))
        for prefix, level in levels:
            if name == "config.json" and vocab is None and isinstance(level.get("vocab_size"), int):
                vocab, vocab_where = level["vocab_size"], f"config.json {prefix}vocab_size"
            for role in (*STRICT_ROLES, *SOFT_ROLES):
                for i in _stated_ids(level.get(f"{role}_token_id")):
                    stated.setdefault((role, i), []).append(f"{name} {prefix}{role}_token_id")
    ids = tuple(StatedId(" and ".join(where), role, i) for (role, i), where in stated.items())
    return ModelIds(vocab, vocab_where, ids)


def _stated_ids(value: Any) -> list[int]:
    """The ids of one key: an int or a list of them; null or a negative sentinel states none."""
    values = value if isinstance(value, list) else [value]
    return [i for i in values if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def tokenizer_ids(tok: Any) -> TokenizerIds:
    decoder = getattr(tok, "added_tokens_decoder", None) or {}
    control = {int(i) for i in decoder} | {int(i) for i in (tok.all_special_ids or []) if int(i) >= 0}
    known = {int(i) for i in tok.get_vocab().values()} | control
    top = max(known, default=len(tok) - 1)

    def describe(i: int) -> str:
        try:
            return repr(tok.convert_ids_to_tokens(int(i)))
        except Exception:
            return "(no token)"

    roles = {r: getattr(tok, f"{r}_token_id", None) for r in (*STRICT_ROLES, *SOFT_ROLES)}
    return TokenizerIds(len(tok), int(top), roles, frozenset(control), frozenset(known), describe)


# -- the verdict on the config ----------------------------------------------------------------------------
def vocab_findings(model: ModelIds, tok: TokenizerIds) -> tuple[list[str], list[str]]:
    """(fatal, warning) findings on the vocabulary sizes."""
    if model.vocab_size is None:
        return [], ["the model's config.json states no vocab_size: the vocabulary sizes were not compared"]
    if tok.span > model.vocab_size:
        return [
            f"the tokenizer's ids reach {tok.span - 1} ({tok.size} tokens) but the model has "
            f"{model.vocab_size} embedding rows ({model.vocab_where}): ids "
            f"{model.vocab_size}..{tok.span - 1} have no row"
        ], []
    extra = model.vocab_size - tok.span
    if extra > max(PADDING_ROWS_SLACK, model.vocab_size // 20):
        return [], [
            f"the model has {model.vocab_size} embedding rows ({model.vocab_where}) but the tokenizer only "
            f"{tok.span} ids: {extra} rows more than padding explains; check that they belong together"
        ]
    return [], []


def special_id_finding(stated: StatedId, tok: TokenizerIds) -> str | None:
    """Why a stated id is not the tokenizer's token of that role, or None when it is acceptable: the
    tokenizer's own id of the role, or any of its control tokens (Kimi's config ends with [EOS] where its
    template ends a turn with <|im_end|>: both are control tokens)."""
    own = tok.roles.get(stated.role)
    if stated.id == own or stated.id in tok.control:
        return None
    if stated.id >= tok.span:
        what = f"past the tokenizer's last id {tok.span - 1}"
    elif stated.id not in tok.known:
        what = "an id the tokenizer has no token for"
    else:
        what = f"an ordinary text token of the tokenizer ({tok.describe(stated.id)})"
    theirs = f"{tok.describe(own)} (id {own})" if own is not None else "not set"
    return f"the model's {stated.where}: {stated.id}, {what}; the tokenizer's {stated.role} token is {theirs}"


def judge_pairing(model: ModelIds, tok: TokenizerIds, same_checkpoint: bool) -> tuple[list[str], list[str]]:
    """(fatal, warning) findings of one tokenizer against one model's config."""
    fatal, warn = vocab_findings(model, tok)
    for stated in model.stated:
        finding = special_id_finding(stated, tok)
        if finding is None:
            continue
        (warn if same_checkpoint or stated.role in SOFT_ROLES else fatal).append(finding)
    return fatal, warn


def model_pairing(target: TargetConfig, base_dir: str | Path) -> PairingReport:
    """The config comparison, remembered when it passed (keyed by the tokenizer's files, the model's config
    files and these rules), so a step that found the tokenizer's preflight remembered loads no tokenizer."""
    files, missing = model_config_files(target, base_dir)
    if missing:
        return PairingReport(warnings=[_could_not_check(target, missing)])
    tok_ref, model_ref = resolve(target.tokenizer, base_dir), resolve(target.model, base_dir)
    record = _pass_record(target, tok_ref, files)
    if record is not None and record.is_file():
        try:
            return PairingReport(warnings=list(json.loads(record.read_text(encoding="utf-8"))["warnings"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged record: judge again
    try:
        tok = tokenizer_ids(load_tokenizer(tok_ref, target.trust_remote_code, target.revision))
        model = read_model_ids(files)
    except Exception as e:
        return PairingReport(warnings=[_could_not_check(target, f"{type(e).__name__}: {e}")])
    fatal, warn = judge_pairing(model, tok, _same_checkpoint(tok_ref, model_ref))
    head = f"target.tokenizer {target.tokenizer!r} and target.model {target.model!r}"
    report = PairingReport(warnings=[f"{head}: {w}" for w in warn])
    if fatal:
        report.problems.append(f"{head} do not belong together: {'; '.join(fatal)}. Fix: {PAIRING_FIX}")
    elif record is not None:
        _remember(record, report.warnings)
    return report


def _same_checkpoint(tok_ref: str, model_ref: str) -> bool:
    if Path(tok_ref).exists():
        return Path(tok_ref).resolve() == Path(model_ref).resolve()
    return tok_ref == model_ref  # one hub id


def _could_not_check(target: TargetConfig, why: str) -> str:
    return (
        f"could not check that target.tokenizer {target.tokenizer!r} and target.model {target.model!r} "
        f"belong together: {why}"
    )


def _pass_record(target: TargetConfig, tok_ref: str, files: dict[str, Path]) -> Path | None:
    """Where a passed comparison is remembered, or None where it cannot be safely (a hub or remote-code
    tokenizer, whose files are not keyed)."""
    key = tokenizer_files_key(tok_ref, target.trust_remote_code, target.revision)
    if key is None:
        return None
    digest = hashlib.blake2b("\x1f".join([key, target.tokenizer, target.model]).encode(), digest_size=12)
    try:
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + files[name].read_bytes())
        for rules in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(rules.read_bytes())
    except OSError:
        return None
    return cache_root() / "pairing-passed" / f"{digest.hexdigest()}.json"


def _remember(record: Path, warnings: list[str]) -> None:
    from contextlib import suppress

    from ..storage.files import write_json

    with suppress(OSError):  # a read-only cache: compared afresh every time
        write_json({"warnings": warnings}, record)


# -- the vLLM servers that extract hidden states
# --------------------------------------------------------------
@dataclass(frozen=True)
class Probe:
    """One `/tokenize` request and the ids our tokenizer gives the same input."""

    kind: Literal["text", "chat"]  # text: a difference is fatal; chat: a warning
    shown: str  # what was tokenized, for the message
    body: dict[str, Any]
    ours: list[int]


def build_probes(tok: Any, target: TargetConfig, model: str | None) -> list[Probe]:
    """The probe text (with the tokenizer's special tokens appended: their ids must agree too), and the chat
    form where our template renders it."""
    specials = "".join(s for s in (tok.bos_token, tok.eos_token) if isinstance(s, str))
    text = PROBE_TEXT + specials
    base = {"model": model} if model else {}
    probes = [
        Probe(
            "text",
            text,
            {**base, "prompt": text, "add_special_tokens": False},
            list(tok(text, add_special_tokens=False)["input_ids"]),
        )
    ]
    kwargs = dict(target.chat_template_kwargs)
    try:
        rendered = tok.apply_chat_template(PROBE_CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception:
        return probes  # no template here: the tokenizer's preflight says so
    body = {**base, "messages": PROBE_CHAT, "add_generation_prompt": True, "add_special_tokens": False}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    probes.append(
        Probe(
            "chat",
            "a system and a user message",
            body,
            list(tok(rendered, add_special_tokens=False)["input_ids"]),
        )
    )
    return probes


def server_root(base_url: str) -> str:
    """`/tokenize` lives at the server's root, beside `/v1`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _tokenize(root: str, body: dict[str, Any], timeout: float) -> list[int]:
    request = urllib.request.Request(
        f"{root}/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urlopen(request, timeout=timeout) as response:
        tokens = json.loads(response.read()).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(i, int) for i in tokens):
        raise ValueError("the answer has no list of token ids under 'tokens'")
    return tokens


def probe_server(base_url: str, probes: list[Probe], tok_ref: str, timeout: float) -> PairingReport:
    """One server's verdict: its ids of each probe against ours."""
    root, report = server_root(base_url), PairingReport()
    for probe in probes:
        try:
            theirs = _tokenize(root, probe.body, timeout)
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode("utf-8", "replace")
            report.warnings.append(_unchecked_server(root, f"POST /tokenize answered {e.code}: {detail}"))
            return report
        except (OSError, ValueError) as e:
            report.warnings.append(_unchecked_server(root, f"{type(e).__name__}: {e}"))
            return report
        if theirs == probe.ours:
            continue
        at = next((i for i, (a, b) in enumerate(zip(theirs, probe.ours, strict=False)) if a != b), None)
        at = min(len(theirs), len(probe.ours)) if at is None else at
        seen = f"{probe.shown!r}" if probe.kind == "text" else probe.shown
        what = (
            f"the vLLM server at {root} tokenizes {seen} to {theirs}, target.tokenizer {tok_ref!r} to "
            f"{probe.ours} (first difference at token {at})"
        )
        if probe.kind == "text":
            report.problems.append(f"{what}: the server runs another tokenizer. Fix: {SERVER_FIX}")
            return report  # the chat form can only differ too
        report.warnings.append(
            f"{what}: the server's chat template differs from ours (the extraction sends ids, so its "
            "states are unaffected; a server that also generates answers would render prompts differently)"
        )
    return report


def _unchecked_server(root: str, why: str) -> str:
    return (
        f"could not check the tokenizer of the vLLM server at {root} against target.tokenizer: {why} "
        "(start it before extracting hidden states; `eagle3 preflight` checks it then)"
    )


def served_pairing(cfg: ProjectConfig, timeout: float = SERVER_TIMEOUT_S) -> PairingReport:
    """Every configured hidden-states server, asked at once."""
    t = cfg.target
    tok_ref = resolve(t.tokenizer, cfg.base_dir)
    try:
        probes = build_probes(
            load_tokenizer(tok_ref, t.trust_remote_code, t.revision), t, cfg.hidden_states.vllm.model
        )
    except Exception as e:
        return PairingReport(warnings=[_unchecked_server("(every server)", f"{type(e).__name__}: {e}")])
    urls = cfg.hidden_states.vllm.base_urls
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        verdicts = list(pool.map(lambda u: probe_server(u, probes, t.tokenizer, timeout), urls))
    report = PairingReport()
    for verdict in verdicts:
        report.add(verdict)
    return report


def pairing_preflight(cfg: ProjectConfig) -> PairingReport:
    """Both comparisons, for `eagle3 preflight` and the responses step. Nothing to say while the target is
    unpinned: its tokenizer must not be loaded then (the pin problem is reported by the tokenizer's
    preflight)."""
    if pin_problems(cfg.target, cfg.base_dir):
        return PairingReport()
    report = model_pairing(cfg.target, cfg.base_dir)
    if cfg.hidden_states.engine == "vllm":
        report.add(served_pairing(cfg))
    return report
