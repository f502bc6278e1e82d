from nanoserve.bench.cli import main

main()
