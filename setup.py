"""Builds the NCCL tuner plugin into the package when a C compiler is present; without one the
install still succeeds and ``hyperagent nccl-plugin`` builds it on demand into a cache."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithNcclPlugin(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        here = Path(__file__).resolve().parent / "hyperagent" / "nccl" / "__init__.py"
        spec = importlib.util.spec_from_file_location("_hyperagent_nccl", here)
        assert spec is not None and spec.loader is not None
        plugin = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = plugin  # dataclasses look their module up
        spec.loader.exec_module(plugin)
        if plugin.compiler() is None:
            print("hyperagent: no C compiler; `hyperagent nccl-plugin` will build the plugin")
            return
        target = Path(self.build_lib) / "hyperagent" / "nccl" / plugin.LIBRARY_NAME
        try:
            plugin.build(target)
        except plugin.PluginBuildError as e:
            print(f"hyperagent: the NCCL tuner plugin was not built ({e})")


setup(cmdclass={"build_py": BuildPyWithNcclPlugin})
