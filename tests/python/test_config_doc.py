"""docs/config.md lists every config key tidal accepts: its tables are
written from the schemas by scripts/config_doc.py, and this test fails when
a schema changed and the document was not regenerated."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_doc_is_current():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_doc.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout


def test_config_doc_names_every_schema_key():
    from tidal import config, data_parallel, dtr, recompute

    doc = (ROOT / "docs" / "config.md").read_text()

    def leaves(schema, prefix=""):
        for key, spec in schema.items():
            path = f"{prefix}{key}"
            if isinstance(spec, dict):
                yield from leaves(spec, path + ".")
            else:
                yield path
    keys = list(leaves(config.SCHEMA))
    keys += [f"tidal.dtr.{k}" for k in dtr.CONFIG_SCHEMA]
    keys += [f"tidal.data_parallel.{k}" for k in data_parallel.SCHEMA]
    keys += [f"tidal.recompute.{k}" for k in recompute.CONFIG_KEYS
             if k not in config.SCHEMA["activation_checkpointing"]]
    missing = [k for k in keys if f"`{k}`" not in doc]
    assert not missing, f"docs/config.md does not name: {missing}"
