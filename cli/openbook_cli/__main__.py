from openbook_cli.app import main

main()
