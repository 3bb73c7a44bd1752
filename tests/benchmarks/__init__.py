"""Tests of the benchmarks' own logic (bench/), on tiny sizes."""
