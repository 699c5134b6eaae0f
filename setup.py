"""monet_like: a schedule compiler for memory-bounded training."""

from setuptools import find_packages, setup

setup(
    name="monet_like",
    version="0.1.0",
    description="MILP schedule compiler for memory-bounded deep-learning training",
    packages=find_packages(include=["monet_like", "monet_like.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch==2.14.1",
        "torchvision==0.29.1",
        "cvxpy>=1.5",
        "cylp>=0.92",
        "highspy>=1.7",
        "pulp>=2.8",
        "pandas>=2.0",
        "ninja>=1.11",
        "tqdm>=4.66",
        "matplotlib>=3.8",
    ],
    entry_points={"console_scripts": ["monet_like=monet_like.cli:main"]},
)
