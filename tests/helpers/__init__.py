"""What the tests share: configs, reference runs, datasets and components they train, child
processes they start. No test module imports another; they import from here."""
