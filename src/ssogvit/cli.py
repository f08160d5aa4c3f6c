"""`ssogvit <command> ...`: one console script, each command implemented where its work lives."""

from __future__ import annotations

import importlib
import sys

# command -> (module, function, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "main": ("ssogvit.train.main_job", "main", "train SSoG and its MHA twin on the embedded digits data; print a table"),
    "train": ("ssogvit.train.cli", "train_main", "train a model (Hydra overrides, e.g. experiment=cifar100_vit_base_ssog)"),
    "eval": ("ssogvit.train.cli", "eval_main", "evaluate a checkpoint, optionally at another image or patch size"),
    "transfer": ("ssogvit.train.cli", "transfer_main", "linear probe or fine-tune a checkpoint on another dataset"),
    "convert": ("ssogvit.convert.cli", "convert_main", "turn a trained attention ViT into an SSoG ViT (fit + distil)"),
    "list": ("ssogvit.train.cli", "list_main", "list models, mixers and experiment configs"),
    "report": ("ssogvit.train.report", "main", "paper tables (ours beside the paper's) and curves from finished runs"),
    "bench": ("ssogvit.bench.cli", "main", "efficiency benchmarks: models, operator, flops"),
    "export": ("ssogvit.export", "main", "write a checkpoint as ONNX, TorchScript or an exported program; check parity"),
    "analyze": ("ssogvit.analysis.cli", "main", "look inside a model: fields, atoms, lipschitz, sinks, steering, transfer"),
}


def _usage() -> str:
    lines = ["usage: ssogvit <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `ssogvit <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ssogvit: unknown command {name!r}; expected one of: {', '.join(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
