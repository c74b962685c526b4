"""Maps the design card's top-level folders onto the ``dsplug`` import package.

core/    -> dsplug
plugins/ -> dsplug.plugins
csrc/    -> dsplug.csrc   (C++ sources shipped as package data for the op builder)
All metadata lives in pyproject.toml.
"""
from setuptools import find_packages, setup

FOLDERS = {"dsplug": "core", "dsplug.plugins": "plugins", "dsplug.csrc": "csrc"}


def _packages():
    names = []
    for package, folder in FOLDERS.items():
        names.append(package)
        names += [f"{package}.{sub}" for sub in find_packages(folder)]
    return names


setup(
    package_dir=FOLDERS,
    packages=_packages(),
    package_data={"dsplug.csrc": ["**/*.cpp", "**/*.h", "*.cpp", "*.h"], "dsplug": ["data/*", "**/*.json", "**/*.txt"],
                  "dsplug.plugins.train": ["default_config.json", "data/*"]},
    include_package_data=True,
)
