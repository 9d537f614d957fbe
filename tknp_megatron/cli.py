"""The command-line parser of every tool and example: argparse's, with a refusal as one line.

argparse prints its usage lines before an error; a refusal here is the single line
``<prog>: error: <flag> <value>: <limit>`` on stderr and exit status 2 (``--help`` still shows
the usage), the same form the tools print for the checks argparse cannot make.
"""

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose ``error`` writes one line and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")
