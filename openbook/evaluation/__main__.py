from openbook.evaluation.cli import main

main()
