from pipeline.model.builtin import main

main()
