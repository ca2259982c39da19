"""Which message roles a chat template accepts: the four of the API, plus the ones the template declares.

Owns the rule. `system`, `user`, `assistant` and `tool` are always accepted (every spec names them; a template
that cannot render one refuses it itself, with raise_exception). Any other role is accepted only when the
template declares it, and a template declares a role when its source compares a message's role with that name
as a string literal: `message.role == "developer"`, `message['role'] in ["user", "ipython"]`, or the same on a
variable set from the role (`{% set role = message['role'] %}` ... `role == "developer"`). A role the template
only renders generically (`'<|im_start|>' + message['role']`) is not declared: such a template would print any
string a client sends, which is how `{"role": "hacker"}` used to become a turn of its own.

NOTE: the rule reads the template's syntax tree, not its text, so a role name that appears in a system prompt
written into the template ("You are a developer") does not count; and a declared name must look like a role
(letters, digits, '_', '-'), so a literal such as '<|im_start|>' compared with a role is never a role.
"""

from __future__ import annotations

import re

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool"})
ROLE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


def accepted_roles(template_source: str | None) -> frozenset[str]:
    """The standard roles plus those `template_source` declares (see the module docstring)."""
    if template_source is None:
        return STANDARD_ROLES
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        tree = env.parse(template_source)
    except jinja2.TemplateSyntaxError:
        return STANDARD_ROLES  # ChatTemplate refuses such a template itself; nothing is declared
    role_names = _role_variables(tree)
    declared: set[str] = set()
    for compare in tree.find_all(nodes.Compare):
        sides = [compare.expr, *(operand.expr for operand in compare.ops)]
        if any(_is_role(side, role_names) for side in sides):
            for side in sides:
                declared.update(_string_literals(side))
    return STANDARD_ROLES | {name for name in declared if ROLE_NAME.fullmatch(name)}


def _is_role_access(node: nodes.Node) -> bool:
    """`x.role` or `x['role']`."""
    if isinstance(node, nodes.Getattr):
        return node.attr == "role"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "role"
    return False


def _role_variables(tree: nodes.Template) -> frozenset[str]:
    """Names the template assigns a message's role to (`{% set role = message['role'] %}`), one level deep."""
    names = set()
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and (
            _is_role_access(assign.node) or any(_is_role_access(n) for n in assign.node.find_all(nodes.Expr))
        ):
            names.add(assign.target.name)
    return frozenset(names)


def _is_role(node: nodes.Node, role_names: frozenset[str]) -> bool:
    while isinstance(node, nodes.Filter) and node.node is not None:  # message.role | lower
        node = node.node
    if isinstance(node, nodes.Name):
        return node.name in role_names
    return _is_role_access(node)


def _string_literals(node: nodes.Node) -> list[str]:
    """The string constants of a comparison's side: a literal, or a literal list or tuple (`in [...]`)."""
    if isinstance(node, nodes.Const):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, (nodes.List, nodes.Tuple)):
        return [
            item.value for item in node.items if isinstance(item, nodes.Const) and isinstance(item.value, str)
        ]
    return []
