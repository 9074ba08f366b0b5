"""A planted pickle payload for the tests that check a file's code never runs."""

from pathlib import Path


class Payload:
    """Unpickling this creates its marker file: proof that a file's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))
