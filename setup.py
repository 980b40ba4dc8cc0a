from setuptools import find_namespace_packages, setup

setup(
    name="megatron-zero-bubble",
    version="0.1.0",
    description="Zero-bubble pipeline parallelism for megatron-core, as a runtime patch set",
    python_requires=">=3.10",
    # `megatron` is a namespace package shared with megatron-core: never add megatron/__init__.py.
    packages=find_namespace_packages(include=["megatron.zero_bubble", "megatron.zero_bubble.*"]),
    install_requires=["highspy>=1.7", "matplotlib>=3.7"],
    extras_require={"test": ["pytest>=7"]},
    entry_points={"console_scripts": ["zb-schedule=megatron.zero_bubble.schedules.cli:main"]},
)
