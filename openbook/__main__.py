from openbook.cli import main

main()
