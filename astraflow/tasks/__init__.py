"""Prompt sources shared by the dataflow rank (training tasks), warm-up and evaluation."""
