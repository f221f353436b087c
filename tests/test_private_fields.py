"""No module reads or writes another object's private fields: a field whose name starts
with one underscore is used through ``self`` (or ``cls``) only, and no module imports
another zerotune module's private names. The exceptions are fields
of other projects' objects that zerotune must reach (torch modules' registries, autograd's
engine, flags that accelerate and transformers read), named below."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Other projects' fields: torch (nn.Module's registries, a tensor's version counter and view base,
# autograd's engine, the C extension, the fused multi-tensor ops torch.optim runs),
# transformers (gradient checkpointing, init flag, generate's rank sync, resize helpers, the
# chat-template compiler),
# accelerate (prepared / scheduler flags), os._exit.
FOREIGN = {
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_version",
    "_base",
    "_is_view",
    "_C",
    "_current_graph_task_id",
    # Whether the running backward will execute an autograd node (which units a loss
    # reaches, grads.py's agree_on_reached); torch's FSDP asks the same.
    "_will_engine_execute_node",
    "_execution_engine",
    "_gradient_checkpointing_func",
    "_is_hf_initialized",
    "_is_accelerate_prepared",
    "_is_fsdp_managed_module",
    "_get_resized_embeddings",
    "_get_resized_lm_head",
    "_compile_jinja_template",
    "_opt_called",
    "_wrapped_by_lr_sched",
    "_exit",
    "_fused_adamw_",
    "_fused_adam_",
    "_foreach_copy_",
    "_foreach_mul_",
}


def _private_uses(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        ours = ("zerotune", "cli")
        if isinstance(node, ast.ImportFrom) and (
            node.level > 0 or (node.module or "").split(".")[0] in ours
        ):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: import {alias.name}")
            continue
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in FOREIGN:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            continue  # the parent class's own method
        found.append(f"{path.relative_to(root)}:{node.lineno}: .{name}")
    return found


def test_no_module_uses_another_objects_private_fields():
    files = sorted((ROOT / "zerotune").rglob("*.py")) + sorted((ROOT / "cli").rglob("*.py"))
    assert len(files) > 40
    found = [use for path in files for use in _private_uses(path)]
    assert found == [], "\n".join(found)


def test_the_check_finds_a_private_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from .io import _agree, load\n"
        "def f(engine):\n    return engine._sync, self._ok, m._parameters\n"
    )
    assert _private_uses(bad, tmp_path) == ["bad.py:1: import _agree", "bad.py:3: ._sync"]
