"""`python -m mtrain` under a stand-in cost model that makes sparse_policy "auto" estimate on every layer, run it
sparse, and find the estimate paid or not from the listed work (so dense holds start and end during a short CPU run).
Used to check that a resumed run takes the uninterrupted one's paths; argv as for `python -m mtrain`."""

import dataclasses
import sys

from mtrain.ops import cost

real_predict = cost.predict


def predict(blocks, columns, **kwargs):
    """The real prediction, sparse chosen; the estimate did not pay (so the layer holds dense) where the listed
    block entries are odd."""
    prediction = real_predict(blocks, columns, **kwargs)
    return dataclasses.replace(prediction, path="sparse", estimate_ms=1e9 if int(blocks) % 2 else 0.0)


cost.predict = predict
cost.worth_estimating = lambda **kwargs: cost.Prediction(dense_ms=1.0, sparse_ms=0.0, path="sparse")

if __name__ == "__main__":
    from mtrain.cli import main

    sys.exit(main(sys.argv[1:]))
