"""The configuration reference: every key documented, the committed page equal to the generated one, and
every key the shipped configs use listed in it."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from eagle3_assets import config_reference as ref
from eagle3_assets.config import DOCS_CONFIG_REFERENCE, ProjectConfig

from .support.projects import REPO

PAGE = REPO / DOCS_CONFIG_REFERENCE
SHIPPED = [REPO / "eagle3.yaml", *sorted((REPO / "configs").glob("*.yaml"))]


def test_every_key_of_the_config_model_has_a_description():
    missing = ref.undocumented(ProjectConfig)
    assert not missing, f"config keys without a description (Field(description=...)): {', '.join(missing)}"


class _Inner(BaseModel):
    documented: int = Field(1, description="Has one.")
    bare: int = 2
    blank: str = Field("", description="  ")


class _Outer(BaseModel):
    inner: _Inner = Field(default_factory=_Inner, description="A table.")
    by_name: dict[str, _Inner] = Field(default_factory=dict)
    items: list[_Inner] | None = Field(None, description="A list of tables.")


def test_the_description_check_names_each_undocumented_key_at_any_depth():
    assert ref.undocumented(_Outer) == [
        "inner.bare",
        "inner.blank",
        "by_name",
        "by_name.<key>.bare",
        "by_name.<key>.blank",
        "items[].bare",
        "items[].blank",
    ]


def test_the_committed_page_is_the_generated_reference():
    assert PAGE.is_file(), f"{DOCS_CONFIG_REFERENCE} is missing: {ref.REGENERATE}"
    assert PAGE.read_text(encoding="utf-8") == ref.render(), (
        f"{DOCS_CONFIG_REFERENCE} differs from the config model: {ref.REGENERATE}"
    )
    assert ref.main(["--check", str(PAGE)]) == 0


def test_check_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    assert ref.main(["--check", str(stale)]) == 1  # missing
    ref.main(["--write", str(stale)])
    assert ref.main(["--check", str(stale)]) == 0
    stale.write_text(stale.read_text().replace("`storage.root`", "`storage.rooot`"))
    assert ref.main(["--check", str(stale)]) == 1
    assert "--write" in capsys.readouterr().err


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_key_a_shipped_config_uses_is_in_the_reference(path):
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    used = ref.config_keys(raw)
    assert "datasets.<key>.source" in used and "storage.root" in used  # the walk reads nested tables
    listed = ref.reference_paths()
    page = PAGE.read_text(encoding="utf-8")
    missing = [k for k in used if k not in listed or f"| `{k}` |" not in page]
    assert not missing, f"{path.name} uses keys the reference does not list: {missing}"


def test_free_form_mappings_are_not_keys():
    raw = {"storage": {"options": {"region": "x"}}, "backends": {"openrouter": {"provider": {"order": []}}}}
    assert ref.config_keys(raw) == [
        "storage",
        "storage.options",
        "backends",
        "backends.openrouter",
        "backends.openrouter.provider",
    ]
    # a key the model does not have is listed as written, so the check above would name it
    assert ref.config_keys({"storrage": {"root": "x"}}) == ["storrage"]
    assert "storrage" not in ref.reference_paths()


class _Color(Enum):
    RED = "red"
    BLUE = "blue"


class _Cat(BaseModel):
    kind: Literal["cat"] = Field("cat", description="Which animal.")
    lives: int = Field(9, ge=1, le=9, description="Lives | left.")


class _Dog(BaseModel):
    kind: Literal["dog"] = Field("dog", description="Which animal.")
    tricks: list[str] = Field(default_factory=list, min_length=1, description="Tricks, e.g. `a|b`.")


class _Shapes(BaseModel):
    color: _Color = Field(_Color.RED, description="An enum.")
    mode: Literal["a", "b"] | None = Field(None, description="A choice or nothing.")
    pet: Annotated[_Cat | _Dog, Field(discriminator="kind")] = Field(description="A union of tables.")
    ratio: float = Field(0.5, gt=0, lt=1, description="Bounded.")


def test_the_walk_renders_enums_choices_unions_and_constraints():
    sections = {s.anchor: s for s in ref.sections(_Shapes)}
    assert set(sections) == {"top-level", "pet-kind-cat", "pet-kind-dog"}
    keys = {k.path: k for s in sections.values() for k in s.keys}
    assert keys["color"].type == "one of `red`, `blue`" and keys["color"].default == "`red`"
    assert keys["mode"].type == "one of `a`, `b` or null" and keys["mode"].default == "`null`"
    assert keys["pet"].default == "required"
    assert "[`pet`](#pet-kind-cat)" in keys["pet"].type and "[`pet`](#pet-kind-dog)" in keys["pet"].type
    assert keys["ratio"].type == "number, > 0 and < 1"
    assert keys["pet.lives"].type == "integer, ≥ 1 and ≤ 9"
    assert keys["pet.tricks"].type == "list of strings, at least 1 item"
    page = ref.render(_Shapes)
    # pipes never split a table cell: escaped in text, HTML inside code
    assert "Lives \\| left." in page and "<code>a&#124;b</code>" in page
    assert "## `pet` (kind: cat)" in page and "## `pet` (kind: dog)" in page
