"""``python -m monarch_kernel install [--user|--sys-prefix|--prefix P]``."""

import sys


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] != "install":
        print(
            "usage: python -m monarch_kernel install [--user|--sys-prefix|--prefix PREFIX]",
            file=sys.stderr,
        )
        sys.exit(2)
    from monarch_kernel.kernel.install import main as install_main

    install_main(sys.argv[2:])


if __name__ == "__main__":
    main()
