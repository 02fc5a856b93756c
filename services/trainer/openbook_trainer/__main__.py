from openbook_trainer.cli import main

main()
