from pipeline.models.builtin import main

main()
