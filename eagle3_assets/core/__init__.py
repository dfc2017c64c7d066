"""Plain-Python core of the pipeline: no Dagster import anywhere below this package."""
