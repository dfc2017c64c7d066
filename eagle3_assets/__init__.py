"""eagle3-assets: prompt datasets -> EAGLE-3 drafter training data, as Dagster assets."""
