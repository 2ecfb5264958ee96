"""Trained models to put ramps on: ResNets and VGGs on Fashion-MNIST, MiniLM on Rotten Tomatoes."""

from rampserve.zoo.registry import ZooEntry, get_entry, load_trained, register, zoo_names
from rampserve.zoo.train import train_zoo

__all__ = ["ZooEntry", "get_entry", "load_trained", "register", "train_zoo", "zoo_names"]
