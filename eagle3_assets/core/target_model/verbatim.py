"""Prove, once per chat template, that it writes every message text verbatim, so no row needs its own render.

The tokens stage rebuilds ids from a template plan (one sentinel render per conversation shape) filled with
each row's texts. That is exact only if the template places the texts unchanged and its control flow depends
on the shape alone (roles, which turns carry reasoning), never on what the texts say. Templates that trim (`|
trim`), split reasoning out of content, or branch on `if message.content` break it for some rows, so by
default every row is rendered again and compared with its plan: about a sixth of the stage's time.

This module reads the template's syntax tree (with the Jinja environment transformers renders it in) and
proves the property for templates that only ever do the following with message data: read `role` (part of the
shape) anywhere; write a text (`content` or a reasoning field) into the output, alone or joined with `+`/`~`;
index and loop over the messages; ask whether a field is defined or how many messages there are. Anything else
(a filter, method or test on a text, a text in a condition, a message dict printed or passed to a call,
macros, filter blocks, captured blocks) and the answer is "not proven": the stage then renders every row and
compares. The proof is sound, not complete: it may refuse a template that happens to be verbatim, never the
reverse.
"""

from __future__ import annotations

from jinja2 import TemplateSyntaxError, nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a value may hold, from least to most restricted in use.
CLEAN = 0  # nothing from the messages (options, special tokens, literals)
SHAPE = 1  # decided by the conversation's shape only: roles, field presence, message counts, loop positions
TEXT = 2  # a message text, or text joined with it: may only be written out (or named, then written out)
MESSAGES = 3  # the messages, one of them, or something unknown reached from them: may only be looked into

# transformers passes a message's reasoning under several names.
TEXT_FIELDS = frozenset({"content", "reasoning_content", "thinking", "reasoning"})
SHAPE_FIELDS = frozenset({"role"})
LOOP_SHAPE_ATTRS = frozenset(
    {"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0"}
)
LOOP_ITEM_ATTRS = frozenset({"previtem", "nextitem"})
PRESENCE_TESTS = frozenset({"defined", "undefined", "none", "string", "mapping", "sequence", "iterable"})
COUNT_FILTERS = frozenset({"length", "count"})
ELEMENT_FILTERS = frozenset({"first", "last", "list", "reverse"})
ARITHMETIC = (nodes.Add, nodes.Sub, nodes.Mul, nodes.FloorDiv, nodes.Mod)
# Markup (jinja's safe string) escapes a plain string added to it (`text + ('' | safe)`): never made here.
MARKUP_FILTERS = frozenset({"safe", "e", "escape", "forceescape"})
NONDETERMINISTIC = frozenset({"lipsum", "strftime_now"})  # random text (and Markup); the clock


class NotVerbatim(Exception):
    """The template does something with message data that the proof does not cover."""


def verbatim_problem(template: str, reserved: str = "") -> str | None:
    """None when the template provably writes every message text verbatim under shape-only control flow;
    otherwise the first construct that stops the proof (the stage then checks each row). `reserved`:
    characters the template itself must not write (the sentinels that stand for texts in a plan)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    try:
        tree = env.parse(template)
    except TemplateSyntaxError as e:  # e.g. transformers' {% generation %} tag, unknown here
        return f"not parsed for the proof: {e.message}"
    except Exception as e:  # deep nesting (RecursionError), a huge number literal (ValueError), ...
        return f"not parsed for the proof: {type(e).__name__}"
    for node in tree.find_all((nodes.Const, nodes.TemplateData)):
        value: object = node.data if isinstance(node, nodes.TemplateData) else getattr(node, "value", None)
        if isinstance(value, str) and any(c in value for c in reserved):
            return f"line {node.lineno}: the template writes a character reserved for sentinels"
    try:
        _Flow().prove(tree)
    except NotVerbatim as e:
        return str(e)
    except Exception as e:  # a tree this proof did not expect: no proof, never a failed stage
        return f"the proof stopped: {type(e).__name__}: {e}"
    return None


def _join(a: int, b: int, where: nodes.Node) -> int:
    if {a, b} == {TEXT, MESSAGES}:
        raise NotVerbatim(
            f"line {where.lineno}: a value is a message text in one place and a message in another"
        )
    return max(a, b)


class _Flow:
    """What every name may hold (flow-insensitive, over the whole template: iterated to a fixed point) and a
    check of every use of message data against what the proof allows."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {"messages": MESSAGES}
        self.changed = False

    def prove(self, tree: nodes.Template) -> None:
        for _ in range(50):
            self.changed = False
            self._body(tree.body)
            if not self.changed:
                return
        raise NotVerbatim("the names' values did not settle")

    # -- statements
    # -------------------------------------------------------------------------------------------
    def _body(self, body: list[nodes.Node]) -> None:
        for node in body:
            self._stmt(node)

    def _stmt(self, node: nodes.Node) -> None:
        if isinstance(node, nodes.Output):
            for item in node.nodes:
                if isinstance(item, nodes.TemplateData):
                    continue
                if self._expr(item) == MESSAGES:
                    raise NotVerbatim(f"line {item.lineno}: a message (not one of its texts) is written out")
        elif isinstance(node, nodes.If):
            self._condition(node.test)
            self._body(node.body)
            for branch in node.elif_:
                self._stmt(branch)
            self._body(node.else_)
        elif isinstance(node, nodes.For):
            kind = self._expr(node.iter)
            if kind == TEXT:
                raise NotVerbatim(f"line {node.lineno}: a loop over the characters of a message text")
            self._bind(node.target, kind)
            if node.test is not None:
                self._condition(node.test)
            if node.recursive:
                raise NotVerbatim(f"line {node.lineno}: a recursive loop")
            self._body(node.body)
            self._body(node.else_)
        elif isinstance(node, nodes.Assign):
            kind = self._expr(node.node)
            if not isinstance(node.target, nodes.Name) and kind > SHAPE:
                # a namespace attribute or an unpacking: followed no further
                raise NotVerbatim(f"line {node.lineno}: message data stored in a namespace or unpacked")
            self._bind(node.target, kind)
        elif isinstance(node, nodes.Break | nodes.Continue):
            pass
        else:  # macros, call/filter/captured blocks, includes, imports, with, blocks, do
            raise NotVerbatim(f"line {node.lineno}: {type(node).__name__} is not covered by the proof")

    def _bind(self, target: nodes.Node, kind: int) -> None:
        if isinstance(target, nodes.Name):
            if target.name == "loop":
                raise NotVerbatim(f"line {target.lineno}: 'loop' is assigned")
            old = self.names.get(target.name, CLEAN)
            new = _join(old, kind, target)
            if new != old:
                self.names[target.name] = new
                self.changed = True
        elif isinstance(target, nodes.Tuple):
            for item in target.items:
                self._bind(item, kind)
        elif isinstance(target, nodes.NSRef):
            pass  # only CLEAN or SHAPE values reach here; reading `ns.x` is then CLEAN/SHAPE by its name
        else:
            raise NotVerbatim(f"line {target.lineno}: an assignment target the proof does not follow")

    # -- expressions
    # ------------------------------------------------------------------------------------------
    def _condition(self, node: nodes.Node) -> int:
        """A value that decides control flow (or is combined arithmetically): shape only."""
        return self._condition_kind(self._expr(node), node)

    def _condition_kind(self, kind: int, node: nodes.Node) -> int:
        if kind == TEXT:
            raise NotVerbatim(f"line {node.lineno}: a message text decides what the template writes")
        if kind == MESSAGES:
            raise NotVerbatim(f"line {node.lineno}: a message is tested or combined as a value")
        return kind

    def _expr(self, node: nodes.Node) -> int:  # one case per node type
        if isinstance(node, nodes.Const | nodes.TemplateData):
            return CLEAN
        if isinstance(node, nodes.Name):
            if node.name == "loop":
                raise NotVerbatim(f"line {node.lineno}: 'loop' used other than for its position")
            if node.name in NONDETERMINISTIC:
                raise NotVerbatim(f"line {node.lineno}: {node.name} makes one render differ from the next")
            return self.names.get(node.name, CLEAN)
        if isinstance(node, nodes.Getattr):
            return self._look_into(node.node, node.attr, node)
        if isinstance(node, nodes.Getitem):
            if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
                return self._look_into(node.node, node.arg.value, node)
            owner = self._owner(node.node)
            if isinstance(node.arg, nodes.Slice):
                for bound in (node.arg.start, node.arg.stop, node.arg.step):
                    if bound is not None:
                        self._condition(bound)
            elif owner == MESSAGES and not self._is_integer(node.arg):
                raise NotVerbatim(f"line {node.lineno}: messages indexed by a key the proof cannot tell")
            else:
                self._condition(node.arg)
            return owner
        if isinstance(node, nodes.Add | nodes.Concat):
            parts = [node.left, node.right] if isinstance(node, nodes.Add) else node.nodes
            kinds = [self._expr(p) for p in parts]
            if MESSAGES in kinds:
                raise NotVerbatim(f"line {node.lineno}: a message is joined as a value")
            return max(kinds)
        if isinstance(node, nodes.BinExpr):
            return max(self._condition(node.left), self._condition(node.right))
        if isinstance(node, nodes.UnaryExpr):
            return self._condition(node.node)
        if isinstance(node, nodes.Compare):
            return self._compare(node)
        if isinstance(node, nodes.CondExpr):
            self._condition(node.test)
            kind = self._expr(node.expr1)
            return kind if node.expr2 is None else _join(kind, self._expr(node.expr2), node)
        if isinstance(node, nodes.Tuple | nodes.List):
            return max((self._condition(i) for i in node.items), default=CLEAN)
        if isinstance(node, nodes.Dict):
            return max(
                (max(self._condition(p.key), self._condition(p.value)) for p in node.items), default=CLEAN
            )
        if isinstance(node, nodes.Filter):
            return self._filter(node)
        if isinstance(node, nodes.Test):
            return self._test(node)
        if isinstance(node, nodes.Call):
            kind = self._condition(node.node)
            return max(kind, self._arguments(node))
        raise NotVerbatim(f"line {node.lineno}: {type(node).__name__} is not covered by the proof")

    def _owner(self, node: nodes.Node) -> int:
        kind = self._expr(node)
        if kind == TEXT:
            raise NotVerbatim(f"line {node.lineno}: a message text is sliced, indexed or has a method called")
        return kind

    def _look_into(self, owner_node: nodes.Node, key: str, node: nodes.Node) -> int:
        if isinstance(owner_node, nodes.Name) and owner_node.name == "loop":
            if key in LOOP_SHAPE_ATTRS:
                return SHAPE
            if key in LOOP_ITEM_ATTRS:
                return MESSAGES
            raise NotVerbatim(f"line {node.lineno}: loop.{key} is not covered by the proof")
        owner = self._owner(owner_node)
        if owner != MESSAGES:
            return owner  # a method or field of a value that carries no message text
        if key in SHAPE_FIELDS:
            return SHAPE
        if key in TEXT_FIELDS:
            return TEXT
        return MESSAGES  # another field (absent here), or a method of the list or a dict: followed as unknown

    def _is_integer(self, node: nodes.Node) -> bool:
        """An index that is certainly a number (a position), never a field name."""
        if isinstance(node, nodes.Const):
            return isinstance(node.value, int) and not isinstance(node.value, bool)
        if isinstance(node, nodes.Neg | nodes.Pos):
            return self._is_integer(node.node)
        if isinstance(node, ARITHMETIC):
            return self._is_integer(node.left) and self._is_integer(node.right)
        if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
            return node.attr in LOOP_SHAPE_ATTRS - {"first", "last"}
        # A count (its operand is checked as any other value when the index is evaluated).
        return isinstance(node, nodes.Filter) and node.name in COUNT_FILTERS and not node.args

    def _compare(self, node: nodes.Compare) -> int:
        # `'field' in message` asks which fields a message has: part of its shape.
        if (
            len(node.ops) == 1
            and node.ops[0].op in ("in", "notin")
            and isinstance(node.expr, nodes.Const)
            and isinstance(node.expr.value, str)
        ):
            right = self._expr(node.ops[0].expr)  # once: evaluating it twice is exponential in the nesting
            return SHAPE if right == MESSAGES else self._condition_kind(right, node.ops[0].expr)
        return max(self._condition(k) for k in [node.expr] + [op.expr for op in node.ops])

    def _arguments(self, node: nodes.Filter | nodes.Test | nodes.Call) -> int:
        values = [*node.args, *(k.value for k in node.kwargs)]
        values += [v for v in (node.dyn_args, node.dyn_kwargs) if v is not None]
        return max((self._condition(v) for v in values), default=CLEAN)

    def _filter(self, node: nodes.Filter) -> int:
        if node.node is None:
            raise NotVerbatim(f"line {node.lineno}: a filter block")
        if node.name in MARKUP_FILTERS:
            raise NotVerbatim(
                f"line {node.lineno}: the filter '{node.name}' makes Markup, which escapes text"
            )
        kind = self._expr(node.node)
        args = self._arguments(node)
        if kind == TEXT:
            raise NotVerbatim(f"line {node.lineno}: the filter '{node.name}' is applied to a message text")
        if kind == MESSAGES:
            if node.name in COUNT_FILTERS and not node.args:
                return SHAPE
            if node.name in ELEMENT_FILTERS and not node.args:
                return MESSAGES
            raise NotVerbatim(f"line {node.lineno}: the filter '{node.name}' is applied to messages")
        return max(kind, args)

    def _test(self, node: nodes.Test) -> int:
        kind = self._expr(node.node)
        args = self._arguments(node)
        if kind >= TEXT:
            # A field's presence or type is fixed by the shape (texts are always strings); its value is not.
            if node.name in PRESENCE_TESTS and not node.args:
                return SHAPE
            raise NotVerbatim(f"line {node.lineno}: the test '{node.name}' looks at message data")
        return max(kind, args)
