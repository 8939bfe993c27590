"""AstraFlow test suite."""
