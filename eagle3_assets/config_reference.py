"""The configuration reference, generated from the config model (`config.ProjectConfig`): it cannot drift.

Every key a config file may hold gets a row: its dotted path, its type with its constraints (bounds,
choices), its default as YAML writes it (or "required") and the description its pydantic `Field` carries.
One section per table, keyed by its dotted path (`hidden_states.vllm`); the tables of a mapping are keyed
`<key>` (`datasets.<key>`), those of a list `[]`.

    python -m eagle3_assets.config_reference                 prints the reference (Markdown)
    python -m eagle3_assets.config_reference --write [PATH]  writes it to PATH (default: the committed page)
    python -m eagle3_assets.config_reference --check [PATH]  exits 1 when PATH differs from the reference

The committed page is `docs/reference/configuration.md` (`config.DOCS_CONFIG_REFERENCE`); tests compare it
with this module's output and fail when a field has no description (`undocumented`).
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .config import DOCS_CONFIG, DOCS_CONFIG_REFERENCE, ProjectConfig

MAP_KEY = "<key>"  # a mapping's own keys, in a dotted path: datasets.<key>.source
LIST_ITEM = "[]"  # a list's items: items[].name
REGENERATE = f"python -m eagle3_assets.config_reference --write {DOCS_CONFIG_REFERENCE}"
COMMITTED = Path(__file__).resolve().parent.parent / DOCS_CONFIG_REFERENCE  # the page in this checkout

# Pages that explain a section at length (paths relative to the reference page).
SEE_ALSO = {
    "storage": ("outputs", "../outputs.md"),
    "backends": ("backends and provider limits", "../backends.md"),
    f"datasets.{MAP_KEY}": ("budgets and resume", "../budgets-and-resume.md"),
    "hidden_states": ("hidden states", "../hidden-states.md"),
    "acceptance": ("the acceptance gate", "../acceptance.md"),
    "automation": ("operations", "../operations.md"),
    "pools": ("operations", "../operations.md"),
    "execution": ("operations", "../operations.md"),
}

_BASIC = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "path"}
_UNIONS = (Union, types.UnionType)
_CODE = re.compile(r"(`+)(.+?)\1")


@dataclass(frozen=True)
class Table:
    """A table a field's value opens: the model, the path suffix that reaches it and, for one member of a
    union of tables, what tells it apart."""

    model: type[BaseModel]
    suffix: str = ""
    variant: str = ""


@dataclass(frozen=True)
class Key:
    path: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    path: str  # "" for the top level
    depth: int  # tables above it: 0 for the top level and the tables right below it
    title: str
    anchor: str
    intro: str
    keys: tuple[Key, ...]


# -- walking the model ---------------------------------------------------------------------------------------
def _is_model(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def _members(annotation: Any) -> list[Any]:
    return list(get_args(annotation)) if get_origin(annotation) in _UNIONS else [annotation]


def _is_sequence(origin: Any) -> bool:
    return origin in (list, set, frozenset, tuple) or origin is Sequence


def _is_mapping(origin: Any) -> bool:
    return origin is dict or origin is Mapping


def _variant(model: type[BaseModel], discriminator: str | None) -> str:
    field = model.model_fields.get(discriminator) if discriminator else None
    if field is not None and get_origin(field.annotation) is Literal:
        return f"{discriminator}: {', '.join(_yaml(v) for v in get_args(field.annotation))}"
    return model.__name__


def tables(annotation: Any, discriminator: str | None = None) -> list[Table]:
    """The tables a value of this type opens (nested models, in lists, mappings, optionals and unions)."""
    found: list[Table] = []
    for member in _members(annotation):
        origin, args = get_origin(member), get_args(member)
        if _is_model(member):
            found.append(Table(member))
        elif _is_sequence(origin):
            found += [Table(t.model, LIST_ITEM + t.suffix, t.variant) for a in args for t in tables(a)]
        elif _is_mapping(origin) and len(args) == 2:
            found += [Table(t.model, f".{MAP_KEY}{t.suffix}", t.variant) for t in tables(args[1])]
    models = [t for t in found if not t.suffix]
    if len(models) > 1:  # a union of tables at one path: each section says which
        found = [
            Table(t.model, t.suffix, _variant(t.model, discriminator)) if not t.suffix else t for t in found
        ]
    return found


def _discriminator(field: FieldInfo) -> str | None:
    d = field.discriminator
    return d if isinstance(d, str) else None


def _walk_models(
    model: type[BaseModel], path: str, seen: tuple[type[BaseModel], ...]
) -> Iterator[tuple[str, str, FieldInfo]]:
    """(dotted path, name, field) of every field of `model` and of the tables below it, depth first."""
    if model in seen:  # a recursive model: its keys are listed once, where it first appears
        return
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        yield key, name, field
        for t in tables(field.annotation, _discriminator(field)):
            yield from _walk_models(t.model, key + t.suffix, (*seen, model))


def undocumented(root: type[BaseModel] = ProjectConfig) -> list[str]:
    """Dotted paths of the fields of `root`, and of every model reachable from it, without a description."""
    return [key for key, _, field in _walk_models(root, "", ()) if not (field.description or "").strip()]


def _user_fields(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """The fields a config file may set: not those the loader fills in (`exclude=True`, like `base_dir`)."""
    return [(name, f) for name, f in model.model_fields.items() if f.exclude is not True]


def sections(root: type[BaseModel] = ProjectConfig) -> list[Section]:
    """The reference's sections, depth first: the top level, then each table below it."""
    out: list[Section] = []

    def visit(model: type[BaseModel], path: str, intro: str, variant: str, seen: tuple, depth: int) -> None:
        if model in seen:
            return
        title = (f"`{path}`" if path else "Top level") + (f" ({variant})" if variant else "")
        anchor = _anchor(path, variant)
        keys = []
        children = []
        for name, field in _user_fields(model):
            key = f"{path}.{name}" if path else name
            found = tables(field.annotation, _discriminator(field))
            keys.append(Key(key, _type_cell(field, key, found), _default(field), field.description or ""))
            children += [(t, key, field) for t in found]
        out.append(Section(path, max(depth - 1, 0), title, anchor, intro, tuple(keys)))
        for t, key, field in children:
            visit(t.model, key + t.suffix, field.description or "", t.variant, (*seen, model), depth + 1)

    visit(root, "", "", "", (), 0)
    return out


def reference_paths(root: type[BaseModel] = ProjectConfig) -> set[str]:
    """The dotted path of every key the reference lists."""
    return {k.path for s in sections(root) for k in s.keys}


def config_keys(data: Any, model: type[BaseModel] = ProjectConfig, path: str = "") -> list[str]:
    """The dotted paths (as the reference writes them) of the keys a config mapping sets, read as `model`
    reads them; keys of free-form mappings (`storage.options`, `backends.openrouter.provider`) are not keys of
    the config and are not listed. A key `model` does not have is listed as it is."""
    if not isinstance(data, dict):
        return []
    keys: list[str] = []
    for name, value in data.items():
        key = f"{path}.{name}" if path else str(name)
        keys.append(key)
        field = model.model_fields.get(name)
        if field is not None:
            keys += _value_keys(value, tables(field.annotation, _discriminator(field)), key)
    return keys


def _value_keys(value: Any, found: list[Table], key: str) -> list[str]:
    keys: list[str] = []
    for t in found:
        if not t.suffix and isinstance(value, dict):
            keys += config_keys(value, t.model, key)
        elif t.suffix.startswith(LIST_ITEM) and isinstance(value, list):
            rest = [Table(t.model, t.suffix[len(LIST_ITEM) :], t.variant)]
            for item in value:
                keys += _value_keys(item, rest, key + LIST_ITEM)
        elif t.suffix.startswith(f".{MAP_KEY}") and isinstance(value, dict):
            rest = [Table(t.model, t.suffix[len(MAP_KEY) + 1 :], t.variant)]
            for item in value.values():
                keys += _value_keys(item, rest, f"{key}.{MAP_KEY}")
    return list(dict.fromkeys(keys))


# -- types, constraints and defaults -------------------------------------------------------------------------
def _yaml(value: Any) -> str:
    """A value as YAML writes it in flow style (`null`, `true`, `[a, b]`, `{enabled: true}`)."""
    if isinstance(value, Enum):
        value = value.value
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _choices(values: Sequence[Any]) -> str:
    return "one of " + ", ".join(f"`{_yaml(v)}`" for v in values)


def type_text(annotation: Any) -> str:
    """A type in words: `integer`, `list of string`, `mapping of table`, `one of a, b`, `... or null`."""
    if annotation is Any or annotation is object:
        return "any"
    if annotation is None or annotation is type(None):
        return "null"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in _UNIONS:
        parts = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return _choices(args)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return _choices([m.value for m in annotation])
    if _is_model(annotation):
        return "table"
    if _is_sequence(origin):
        items = [a for a in args if a is not Ellipsis]
        return "list" if not items else f"list of {_plural(type_text(items[0]))}"
    if _is_mapping(origin) or annotation in (dict, Mapping):
        value = args[1] if len(args) == 2 else Any
        return "mapping" if value is Any else f"mapping of {_plural(type_text(value))}"
    if annotation in (list, tuple, set):
        return "list"
    return _BASIC.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _plural(text: str) -> str:
    """`string` -> `strings`; a longer type is written as it is (`list of lists of integers`)."""
    return f"{text}s" if text in (*_BASIC.values(), "table", "list", "mapping") else text


def constraints(field: FieldInfo) -> list[str]:
    """The field's bounds and lengths in words (`≥ 1`, `at least 1 item`, `matching ...`)."""
    what = "item" if _is_sequence(get_origin(field.annotation)) else "character"
    out: list[str] = []
    for m in field.metadata:
        if isinstance(m, at.Ge):
            out.append(f"≥ {_yaml(m.ge)}")
        elif isinstance(m, at.Gt):
            out.append(f"> {_yaml(m.gt)}")
        elif isinstance(m, at.Le):
            out.append(f"≤ {_yaml(m.le)}")
        elif isinstance(m, at.Lt):
            out.append(f"< {_yaml(m.lt)}")
        elif isinstance(m, at.MinLen):
            out.append(f"at least {m.min_length} {what}{'' if m.min_length == 1 else 's'}")
        elif isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length} {what}{'' if m.max_length == 1 else 's'}")
        elif isinstance(m, at.MultipleOf):
            out.append(f"a multiple of {_yaml(m.multiple_of)}")
        elif getattr(m, "pattern", None):
            out.append(f"matching `{m.pattern}`")
    return out


def _anchor(path: str, variant: str = "") -> str:
    """The section's HTML id: its path (`datasets.key.fields`), and for a union's member what tells it
    apart."""
    anchor = path.replace(MAP_KEY, "key").replace(LIST_ITEM, "") if path else "top-level"
    if variant:
        anchor += "-" + re.sub(r"[^a-z0-9]+", "-", variant.lower()).strip("-")
    return anchor


def _type_cell(field: FieldInfo, key: str, found: list[Table]) -> str:
    text = type_text(field.annotation)
    bounds = constraints(field)
    if bounds:
        text += ", " + " and ".join(bounds)
    links = []
    for t in found:
        path = key + t.suffix
        links.append(f"[`{path}`](#{_anchor(path, t.variant)})")
    if links:
        text += ": see " + ", ".join(links)
    return text


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "each key's default"
    return f"`{_yaml(value)}`"


# -- Markdown ------------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    """Text safe in a Markdown table cell, in MkDocs (Python-Markdown) and on GitHub alike: pipes outside code
    escaped, code that holds a pipe written as HTML, `<` outside code as an entity, one line."""
    text = " ".join(text.split())
    out, pos = [], 0
    for m in _CODE.finditer(text):
        out.append(_plain(text[pos : m.start()]))
        code = m.group(2)
        if "|" in code:
            out.append(f"<code>{html.escape(code.strip(), quote=False).replace('|', '&#124;')}</code>")
        else:
            out.append(m.group(0))
        pos = m.end()
    out.append(_plain(text[pos:]))
    return "".join(out)


def _plain(text: str) -> str:
    return text.replace("<", "&lt;").replace("|", "\\|")


def render(root: type[BaseModel] = ProjectConfig) -> str:
    """The whole reference page, as Markdown."""
    lines = [
        "<!-- Generated from the config model in eagle3_assets/config/: do not edit. "
        f"Regenerate with `{REGENERATE}`. -->",
        "",
        "# Configuration reference",
        "",
        "Every key of `eagle3.yaml` (or of the file `EAGLE3_CONFIG` names), with its type, its default and "
        "what it does. This page is generated from the config model in `eagle3_assets/config/`: change a "
        f"key's description there and regenerate it with `{REGENERATE}`; a test fails when the two differ.",
        "",
        "Unknown keys are errors that name the key. A relative path is relative to the config file's folder "
        "unless its key says otherwise, and `null` is YAML's empty value. Which file is read, how to "
        f"override it and how to keep secrets out of it: [configuration](../{Path(DOCS_CONFIG).name}).",
    ]
    for s in sections(root):
        level = "#" * min(2 + s.depth, 6)
        # A heading's own id is its text slugified (`storage`, `top-level`); a dotted path loses its dots
        # there, so those sections get their path as an explicit id (never a slug: slugs have no dots).
        lines += ["", f'<a id="{s.anchor}"></a>'] if "." in s.anchor else [""]
        lines += ["", f"{level} {s.title}", ""] if "." in s.anchor else [f"{level} {s.title}", ""]
        if s.intro:
            lines += [_cell(s.intro), ""]
        see = SEE_ALSO.get(s.path)
        if see:
            lines += [f"See also: [{see[0]}]({see[1]}).", ""]
        lines += ["| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
        lines += [
            f"| `{k.path}` | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.description)} |" for k in s.keys
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m eagle3_assets.config_reference",
        description="The configuration reference (Markdown), generated from the config model.",
    )
    group = p.add_mutually_exclusive_group()
    page = str(COMMITTED)
    group.add_argument("--write", nargs="?", const=page, metavar="PATH", help=f"write it to PATH ({page})")
    group.add_argument(
        "--check",
        nargs="?",
        const=page,
        metavar="PATH",
        help="exit 1 when PATH differs from what --write writes",
    )
    args = p.parse_args(argv)
    missing = undocumented()
    if missing:
        print(f"config keys without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if args.write:
        path = Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    elif args.check:
        path = Path(args.check)
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            state = "is missing" if current is None else "differs from the config model"
            again = f"python -m eagle3_assets.config_reference --write {args.check}"
            print(f"{path} {state}; regenerate it: {again}", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
