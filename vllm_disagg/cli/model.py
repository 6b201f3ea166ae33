# SPDX-License-Identifier: Apache-2.0
"""`vllm-disagg model pull|path|list|verify`: the embedded models (see vllm_disagg.models)."""

from __future__ import annotations

import sys


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("model", help="Pull and locate embedded models (no hub needed)")
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    pull = sub.add_parser("pull", help="Download and convert a model into the cache (no-op when done)")
    pull.add_argument("name")
    pull.add_argument("--force", action="store_true", help="Convert again even if a verified copy exists")
    path = sub.add_parser("path", help="Print the model's directory")
    path.add_argument("name")
    verify = sub.add_parser("verify", help="Check the cached files against the recorded checksums")
    verify.add_argument("name")
    sub.add_parser("list", help="List embedded models")
    parser.set_defaults(func=run)


def run(args) -> int:
    from vllm_disagg import models

    try:
        if args.model_command == "pull":
            print(models.pull(args.name, force=args.force))
        elif args.model_command == "path":
            print(models.resolve_model(models._spec(args.name).name))
        elif args.model_command == "verify":
            ok = models.verify(models._spec(args.name).name)
            print("ok" if ok else "checksum mismatch or not pulled")
            return 0 if ok else 1
        else:
            for name, spec in sorted(models.CATALOG.items()):
                state = "pulled" if models.is_pulled(name) else "not pulled"
                print(f"{name:16s} {state:11s} {spec.description}")
    except models.ModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
