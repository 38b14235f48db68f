"""Build hook: keep the modules that only work in a source checkout out of the wheel (metadata is in pyproject.toml).

``torsh.demo`` reads ``migration_examples/`` next to the package, and the schema regenerators rewrite the schema
files next to themselves; installed, the first fails and the others would rewrite files inside site-packages.
An editable install (``make venv``) maps the package onto the checkout, so ``make run`` and ``make schemas`` keep
working there.
"""

from setuptools import setup
from setuptools.command.build_py import build_py

#: (package, module) pairs left out of built wheels.
CHECKOUT_ONLY = {("torsh", "demo"), ("torsh.schemas", "__main__"), ("torsh.schemas", "_generate_deepspeed"),
                 ("torsh.schemas", "_generate_accelerate_keys"), ("torsh.schemas", "_generate_torchtitan_keys"),
                 ("torsh.schemas", "_generate_torchtune_keys"), ("torsh.schemas", "_generate_torchtitan_schema"),
                 ("torsh.schemas", "_generate_horovod_keys")}


class BuildPyWithoutCheckoutTools(build_py):
    """``build_py`` minus :data:`CHECKOUT_ONLY`."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) not in CHECKOUT_ONLY]


setup(cmdclass={"build_py": BuildPyWithoutCheckoutTools})
