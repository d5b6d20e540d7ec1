from ckptd.cli import main

main()
