"""The phone runs without torch: every edge_client module imports with torch (and transformers) blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

MODULES = ["edge_client", "edge_client.config", "edge_client.errors", "edge_client.front",
           "edge_client.tokenizer", "edge_client.activation_cache", "edge_client.transport",
           "edge_client.generation", "edge_client.request", "edge_client.client", "edge_client.local_api", "edge_client.cli",
           "edge_client.demo", "shared.openai_compat"]


def test_edge_modules_import_without_torch():
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, sys

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "safetensors", "partition_tools",
                                          "cloud_server"):
                    raise ImportError(f"blocked on the phone: {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        for m in {MODULES!r}:
            importlib.import_module(m)
        import edge_client.cli as cli
        cli.build_parser().parse_args(["chat", "--bundle", "b", "--url", "ws://x"])
        assert not any(k.split(".")[0] in ("torch", "transformers") for k in sys.modules)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"


def test_blocker_really_blocks():
    # the hook above must be able to fail: importing torch under it raises
    code = ("import importlib.abc, sys\n"
            "class B(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, n, p=None, t=None):\n"
            "        if n.split('.')[0] == 'torch': raise ImportError('blocked')\n"
            "sys.meta_path.insert(0, B())\n"
            "import torch\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "blocked" in r.stderr
